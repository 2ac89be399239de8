"""Service configuration: environment variables (prefix ``MTPSERVE_``) and command-line flags.

The command line (``mtpserve serve``) overrides the environment, which overrides the defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL_DIR = Path("models/demo")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MTPSERVE_", extra="forbid")

    # What to serve and where.
    model: Path = DEFAULT_MODEL_DIR
    served_model_name: str | None = None  # None: the model folder's name
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    metrics_host: str | None = None  # None: same as host
    metrics_port: int = Field(9464, ge=0, le=65535)
    tenants: Path | None = None  # None: one development tenant with a random key

    # Engine.
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = Field(64, ge=1)
    kv_memory_mb: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    prefill_chunk_tokens: int | None = Field(None, ge=1)  # None: the engine default per device
    # EngineConfig.overlap_steps: launch steady decode steps ahead; None: on CUDA, off on a CPU.
    overlap_steps: bool | None = None
    # EngineConfig.drafting_layer: the MTP modules' fused drafting forward; None: on CUDA in 16 bits.
    drafting_layer: bool | None = None
    spec_method: Literal["none", "chain", "tree", "adaptive"] = "adaptive"
    spec_topk: int | None = Field(None, ge=1)
    spec_depth: int | None = Field(None, ge=1)
    spec_num_draft_tokens: int | None = Field(None, ge=1)
    # SpecConfig.chain_depths (adaptive only): its chain arms' depths, e.g. MTPSERVE_SPEC_CHAIN_DEPTHS="[4,6]".
    spec_chain_depths: tuple[int, ...] | None = None

    # Admission and limits.
    max_waiting: int = Field(256, ge=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    default_max_tokens: int = Field(256, ge=1)  # chat requests without max_tokens
    max_stop_strings: int = Field(16, ge=1)

    # Sessions.
    session_idle_timeout_s: float = Field(600.0, gt=0)
    session_reap_interval_s: float = Field(5.0, gt=0)

    # Shutdown.
    drain_timeout_s: float = Field(30.0, ge=0)

    # Logs.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_text: bool = False  # debug only: put prompt and completion text into request logs

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name or "model"
