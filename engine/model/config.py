"""ModelConfig: the DeepSeek-V3 hyper-parameters the engine needs, parsed from an HF `config.json`.

Accepts both spellings of the RoPE settings (`rope_scaling` of the published config and
`rope_parameters` of transformers 5) and reports missing or invalid keys precisely.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings. ``rope_type`` is "default" or "yarn" (DeepSeek-V3's published setting)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"
    # MTP modules config.json declares when the checkpoint holds fewer (None: all present)
    declared_mtp_modules: int | None = None

    # ---- derived ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token per layer: the compressed latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_mtp_modules(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Dense MLP for the first ``first_k_dense_replace`` layers, MoE after (MTP layers too)."""
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    # ---- (de)serialisation ----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in _REQUIRED_KEYS if raw.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing required keys: {', '.join(missing)}")
        scoring = raw.get("scoring_func", "sigmoid")
        if raw.get("n_routed_experts") and scoring != "sigmoid":
            raise ValueError(f"unsupported scoring_func {scoring!r}: DeepSeek-V3 routing is sigmoid")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw.get('hidden_act')!r}: only 'silu'")
        n_routed = int(raw.get("n_routed_experts") or 0)
        if n_routed:
            for key in ("moe_intermediate_size", "num_experts_per_tok"):
                if not raw.get(key):
                    raise ValueError(f"config.json has n_routed_experts but no {key}")
        n_group = int(raw.get("n_group") or 1)
        if n_routed and n_routed % n_group:
            raise ValueError(f"n_routed_experts={n_routed} is not divisible by n_group={n_group}")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=n_routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=n_group,
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            num_nextn_predict_layers=int(
                raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0
            ),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_parse_rope(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            initializer_range=float(raw.get("initializer_range", 0.02)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            hidden_act="silu",
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"config.json in {folder} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content (transformers 5 spelling: ``rope_parameters``)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rope", "declared_mtp_modules")}
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "yarn":
            rope.update(
                factor=self.rope.factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
                beta_fast=self.rope.beta_fast,
                beta_slow=self.rope.beta_slow,
                mscale=self.rope.mscale,
                mscale_all_dim=self.rope.mscale_all_dim,
            )
        out.update(
            model_type="deepseek_v3",
            architectures=["DeepseekV3ForCausalLM"],
            rope_parameters=rope,
            num_key_value_heads=self.num_attention_heads,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_routed_experts=self.n_routed_experts or None,
        )
        return out


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError("rope_parameters / rope_scaling must be a JSON object")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type {rope_type!r}: only 'default' and 'yarn'")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    max_pos = int(raw.get("max_position_embeddings", 4096))
    original = int(params.get("original_max_position_embeddings", max_pos))
    factor = params.get("factor")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor) if factor is not None else max_pos / original,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
