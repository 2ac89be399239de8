"""Fused layer kernels (engine/kernels/fused_layers.py) vs the model's PyTorch path.

``check_fused(name, device)`` builds random inputs, runs the model's own PyTorch code (``RMSNorm``
under autograd so it cannot take the fused path; ``RotaryEmbedding.rotate`` + ``write_kv``) and
the kernel, and returns ``(max abs error, tolerance)``. Cache slots the kernel must not touch
hold garbage and are compared too. Used under the Triton interpreter on CPU and on the GPU.
"""

from __future__ import annotations

import torch

from engine.attention.reference import write_kv
from engine.model.config import ModelConfig
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding

# name -> (dtype, heads, nope, rope, kv_rank, interleave, tokens)
FUSED_CASES: dict[str, tuple[torch.dtype, int, int, int, int, bool, int]] = {
    "fp32_interleave": (torch.float32, 6, 64, 32, 128, True, 7),
    "fp16_plain": (torch.float16, 3, 16, 16, 40, False, 5),
    "fp32_deepseek_sizes": (torch.float32, 4, 128, 64, 512, True, 3),
    "bf16_interleave": (torch.bfloat16, 5, 32, 32, 64, True, 9),
    "fp32_yarn": (torch.float32, 2, 16, 32, 64, True, 6),  # attention factor != 1
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}


def kernel_tolerance(dtype: torch.dtype) -> float:
    """The largest error a kernel may show against its PyTorch reference in ``dtype``."""
    return 1e-5 if dtype == torch.float32 else 2e-2


def _random_norm(dim: int, gen: torch.Generator, device: str, dtype: torch.dtype, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(dim, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    return norm.to(device=device, dtype=dtype)


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``RMSNorm``'s PyTorch path (under autograd it cannot take the fused one)."""
    with torch.enable_grad():
        return norm(x.detach().requires_grad_(x.dtype.is_floating_point)).detach()


def check_rms_norm(name: str, device: str) -> tuple[float, float]:
    from engine.kernels.fused_layers import rms_norm

    dtype, *_ = FUSED_CASES[name]
    gen = torch.Generator().manual_seed(5)
    norm = _random_norm(96, gen, device, dtype)
    wide = (torch.randn(7, 130, generator=gen) * 3).to(device=device, dtype=dtype)
    x = wide[:, 10:106]  # [7, 96] rows strided like a slice of a projection output
    want = _torch_norm(norm, x)
    got = rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == want.shape
    return (got.double() - want.double()).abs().max().item(), kernel_tolerance(dtype)


def check_add_rms_norm(name: str, device: str) -> tuple[float, float]:
    """The fused residual add + norm against ``x + delta`` and ``RMSNorm``'s PyTorch path, both
    outputs; ``delta`` strided like a slice of a wider projection output."""
    from engine.kernels.fused_layers import add_rms_norm

    dtype, *_ = FUSED_CASES[name]
    gen = torch.Generator().manual_seed(17)
    norm = _random_norm(96, gen, device, dtype)
    x = (torch.randn(6, 96, generator=gen) * 3).to(device=device, dtype=dtype)
    delta = (torch.randn(6, 120, generator=gen) * 3).to(device=device, dtype=dtype)[:, 4:100]
    want_sum = x + delta
    want = _torch_norm(norm, want_sum)
    got_sum, got = add_rms_norm(x, delta, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == want.shape
    return max((got_sum.double() - want_sum.double()).abs().max().item(),
               (got.double() - want.double()).abs().max().item()), kernel_tolerance(dtype)


def check_silu_mul(name: str, device: str) -> tuple[float, float]:
    """The fused ``silu(gate) * up`` against ``SwiGLUMLP``'s PyTorch ops on a fused projection's
    rows (a width that is not a power of two, so the column blocks are masked)."""
    from engine.kernels.fused_layers import silu_mul

    dtype, *_ = FUSED_CASES[name]
    gen = torch.Generator().manual_seed(13)
    gate_up = (torch.randn(7, 2 * 1100, generator=gen) * 4).to(device=device, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    return (got.double() - want.double()).abs().max().item(), kernel_tolerance(dtype) * 4


def check_mtp_input(name: str, device: str) -> tuple[float, float]:
    """The fused MTP input rows against ``MTPLayer.fuse_inputs``' norms and concatenation."""
    from engine.kernels.fused_layers import mtp_input

    dtype, *_ = FUSED_CASES[name]
    gen = torch.Generator().manual_seed(11)
    hidden, vocab, n = 80, 50, 9
    embed = (torch.randn(vocab, hidden, generator=gen) * 2).to(device=device, dtype=dtype)
    enorm, hnorm = _random_norm(hidden, gen, device, dtype), _random_norm(hidden, gen, device, dtype, eps=1e-5)
    ids = torch.randint(0, vocab, (n,), generator=gen).to(device)
    prev = (torch.randn(n, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    want = torch.cat([_torch_norm(enorm, embed[ids]), _torch_norm(hnorm, prev)], dim=-1)
    got = mtp_input(ids, embed, prev, enorm.weight, enorm.eps, hnorm.weight, hnorm.eps)
    assert got.dtype == dtype and got.shape == want.shape
    return (got.double() - want.double()).abs().max().item(), kernel_tolerance(dtype)


def check_rope_latent(name: str, device: str) -> tuple[float, float]:
    from engine.kernels.fused_layers import rope_and_store_latent

    dtype, heads, nope, rope_dim, rank, interleave, n = FUSED_CASES[name]
    cfg = ModelConfig.from_hf_dict({
        "model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": heads, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope_dim, "kv_lora_rank": rank, "v_head_dim": 16,
        "rope_interleave": interleave, "vocab_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        **({"rope_scaling": YARN} if "yarn" in name else {}),
    })
    rope = RotaryEmbedding(cfg).to(device)
    assert ("yarn" in name) == (rope.attention_factor != 1.0)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(n, heads, nope + rope_dim, generator=gen).to(device=device, dtype=dtype)
    kv = (torch.randn(n, rank + rope_dim, generator=gen) * 2).to(device=device, dtype=dtype)
    norm = RMSNorm(rank, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(rank, generator=gen))
    norm = norm.to(device=device, dtype=dtype)
    positions = torch.randint(0, 2000, (n,), generator=gen).to(device)
    cos, sin = rope.cos_sin(positions, dtype)
    cache = torch.full((4, 8, rank + rope_dim), 77.0, dtype=dtype, device=device)
    slots = torch.randperm(32, generator=gen)[:n].to(device)
    want_cache = cache.clone()
    with torch.enable_grad():  # the PyTorch path of RMSNorm
        c_kv = norm(kv[:, :rank].detach().requires_grad_()).detach()
    want_q = rope.rotate(q[..., nope:], cos[:, None, :], sin[:, None, :])
    k_rope = rope.rotate(kv[:, rank:], cos, sin)
    write_kv(want_cache, slots, torch.cat([c_kv, k_rope], dim=-1))
    got_q = rope_and_store_latent(q, kv, norm.weight, norm.eps, positions, rope.inv_freq,
                                  rope.attention_factor, cache, slots, nope, interleave)
    err = max((got_q.double() - want_q.double()).abs().max().item(),
              (cache.double() - want_cache.double()).abs().max().item())
    return err, kernel_tolerance(dtype)
