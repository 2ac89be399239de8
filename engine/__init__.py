"""mtpserve engine: DeepSeek-V3 with MTP speculative decoding over a paged latent KV cache.

No FastAPI here; the HTTP layer lives in ``app/``.
"""

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, SpecStats, ZeroEvent
from engine.params import EngineConfig, SamplingParams, SpecConfig
from engine.step_failure import StepFailed

__all__ = [
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "StepFailed",
    "ZeroEvent",
]
