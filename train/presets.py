"""Named training recipes: model shape, optimiser, phases, corpus size, export format.

- ``demo``: the model shipped at ``models/demo/`` (fp16 weights at most 40 MB including the MTP
  modules, shards under 16 MB). Its size is bound by the weight limit: tied embeddings and a
  q LoRA leave room for 6 layers plus 4 MTP modules at hidden 384.
- ``gpu``: a larger model (12 layers, hidden 768, 6 MTP modules) for GPU speed figures; not
  shipped.
- ``tiny``: seconds on a CPU; tests and smoke runs.

All MLPs are dense: ``first_k_dense_replace`` covers the main and the MTP layers, because at this
size the weight limit, not compute, is what binds, and routed experts would cost weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    # model
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_mtp_modules: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # optimisation (one step = batch_size windows of seq_len tokens)
    seq_len: int
    batch_size: int
    lr: float
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.03  # of the steps, when the run counts steps
    warmup_steps: int = 60  # when the run has a time budget
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3  # DeepSeek-V3's weight of the mean MTP loss early in training
    # the distillation phase: MTP modules towards the main model's own predictions
    distill_frac: float = 0.2  # of the training time left after data preparation
    distill_lr: float = 1e-3
    distill_hard_weight: float = 0.0  # weight of the true-token loss next to the KL term
    # torch.compile the joint phase's loss on CUDA (measured on an H200, demo: ~73 s to compile,
    # then 2.4x the eager throughput; gpu: 81 s for 2x, no gain inside a 4-minute budget). The
    # distillation phase stays eager: its compile (~50 s) does not pay back in a short phase.
    compile_joint: bool = False
    # steps when no time budget is given (CPU runs, tests)
    default_joint_steps: int = 2000
    default_distill_steps: int = 300
    # evaluation on held-out windows
    eval_every_s: float = 45.0
    eval_windows: int = 64
    eval_batch_size: int = 16
    # corpus
    max_train_bytes: int = 320_000_000
    tokenizer_sample_bytes: int = 40_000_000
    heldout_fraction: float = 0.02
    # export
    export_dtype: str = "float16"
    max_shard_bytes: int = 15_000_000
    max_weight_bytes: int | None = None  # the export refuses to exceed it
    extra: dict[str, Any] = field(default_factory=dict)

    def hf_config(self, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
        """The ``config.json`` content of a DeepSeek-V3 model of this shape (dense MLPs)."""
        num_layers_total = self.num_hidden_layers + self.num_mtp_modules
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": self.num_mtp_modules,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_shared_experts": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            # Dense MLP in every layer, the MTP layers (index >= num_hidden_layers) included.
            "first_k_dense_replace": num_layers_total,
            "moe_layer_freq": 1,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "rope_interleave": True,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "use_cache": True,
            "torch_dtype": self.export_dtype,
        }


DEMO = Preset(
    name="demo",
    vocab_size=8192,
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    intermediate_size=896,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_mtp_modules=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    seq_len=1024,
    batch_size=64,
    lr=2e-3,
    compile_joint=True,
    max_weight_bytes=40_000_000,
)

GPU = Preset(
    name="gpu",
    vocab_size=8192,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=2048,
    kv_lora_rank=256,
    q_lora_rank=384,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    # Six modules, one per depth of the GPU default tree (engine/spec/defaults.py): with four,
    # depths 5 and 6 reused module 4 and reached 0.28 and 0.13 of steps at batch 1 (session 36);
    # with six (and 540 s of training) 0.74 and 0.69, and module 6 reused at depths 7-8 still
    # accepts its rank-0 draft 90% and 80% of the time (bench/results/h200-2026-12-04-session37-*).
    num_mtp_modules=6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    seq_len=1024,
    batch_size=64,
    lr=1.2e-3,
    # Of ~165 s left after data preparation in the benchmark's 200 s budget: the joint phase
    # keeps the ~116 s it had at 180 s with 0.2, the MTP distillation gets ~47 s instead of ~27
    # (on an H200 its 27 s had raised the modules' accept(T=1) from 0.73 to 0.80).
    distill_frac=0.3,
    # Compiled, the joint phase runs ~2x faster after ~80 s of compilation: a wash in a 200 s
    # budget, 4x the steps of the eager 200 s run in the 540 s one (938 against ~230 steps on an
    # H200, held-out loss 1.99 against 3.53; scripts/train_on_h200.sh gpu).
    compile_joint=True,
    max_train_bytes=240_000_000,
    max_shard_bytes=400_000_000,
    export_dtype="bfloat16",
)

TINY = Preset(
    name="tiny",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_mtp_modules=3,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    seq_len=64,
    batch_size=8,
    lr=3e-3,
    warmup_frac=0.1,
    warmup_steps=4,
    default_joint_steps=40,
    default_distill_steps=10,
    eval_every_s=1e9,  # only at phase ends
    eval_windows=8,
    eval_batch_size=4,
    max_train_bytes=2_000_000,
    tokenizer_sample_bytes=2_000_000,
    heldout_fraction=0.2,
    max_shard_bytes=100_000,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (DEMO, GPU, TINY)}


def get_preset(name: str, **overrides: Any) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def parse_override(spec: str) -> tuple[str, Any]:
    """``NAME=VALUE`` (``mtpserve train --set``) as a preset field and its value, typed as the
    field is (``none`` for an optional field's None)."""
    known = {f.name: str(f.type) for f in fields(Preset) if f.name not in ("name", "extra")}
    name, sep, raw = spec.partition("=")
    if not sep or name not in known:
        raise ValueError(f"--set takes NAME=VALUE with NAME one of {sorted(known)}; got {spec!r}")
    kind = known[name]
    if kind.endswith("| None") and raw.lower() == "none":
        return name, None
    base = kind.split("|")[0].strip()
    try:
        if base == "bool":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return name, raw.lower() in ("true", "1")
        return name, {"int": int, "float": float, "str": str}[base](raw)
    except (KeyError, ValueError):
        raise ValueError(f"--set {name}: {raw!r} is not a {kind}") from None
