"""``DeepseekV3ForCausalLM.fuse_projections``: linears that read one input become one GEMM.

The engine fuses on CUDA; here (CPU, float32) the fused model must compute what the unfused one
does (the same tokens, logits within float32 rounding), keep every weight's name and value with
no memory added, and fall back to the separate weights when a ``.to()`` has split them again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.model.layers import SwiGLUMLP
from engine.model.loader import load_model
from engine.model.mla import MultiHeadLatentAttention

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def _engine(folder: Path, fuse: bool) -> LLMEngine:
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="tree", topk=2, depth=3, num_draft_tokens=5))
    if fuse:
        eng.model.fuse_projections()
    return eng


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_fused_model_decodes_as_the_unfused_one(which: str, dense_model_dir: Path, moe_model_dir: Path) -> None:
    folder = dense_model_dir if which == "dense" else moe_model_dir  # moe: q LoRA, shared + routed experts
    plain, fused = _engine(folder, False), _engine(folder, True)
    mlps = [m for m in fused.model.modules() if isinstance(m, SwiGLUMLP)]
    assert mlps and all(m._gate_up is not None for m in mlps)
    attn = [m for m in fused.model.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert all((m._qkv_a is not None) == bool(m.q_lora_rank) for m in attn)
    want, got = plain.generate(PROMPTS, GREEDY), fused.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        a = plain.model.logits(plain.model.forward_train(ids))
        b = fused.model.logits(fused.model.forward_train(ids))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_fusion_keeps_names_values_and_memory(moe_model_dir: Path) -> None:
    model = load_model(moe_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    numel = sum(p.numel() for p in model.parameters())
    model.fuse_projections()
    model.fuse_projections()  # idempotent
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert sum(p.numel() for p in model.parameters()) == numel
    mlp = next(m for m in model.modules() if isinstance(m, SwiGLUMLP))
    assert mlp._gate_up is not None and mlp.gate_proj.weight.data_ptr() == mlp._gate_up.data_ptr()
    # A load_state_dict lands in the fused tensor (the parameters are its views).
    model.load_state_dict({k: v * 2 if v.is_floating_point() else v for k, v in before.items()}, strict=False)
    assert torch.equal(mlp._gate_up[: mlp.gate_proj.weight.shape[0]], mlp.gate_proj.weight)


def test_a_dtype_change_splits_the_weights_and_the_forward_follows(dense_model_dir: Path) -> None:
    model = load_model(dense_model_dir)
    model.fuse_projections()
    model.to(torch.float64)  # new tensors per parameter: the fused ones are stale now
    mlp = next(m for m in model.modules() if isinstance(m, SwiGLUMLP))
    x = torch.randn(3, mlp.gate_proj.weight.shape[1], dtype=torch.float64)
    with torch.no_grad():
        want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), want)
