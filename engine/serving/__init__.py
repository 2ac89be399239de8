"""Serving glue around one LLMEngine: the engine thread and its observer interface.

Nothing here imports FastAPI: the HTTP layer (``app/``) builds on these pieces.
"""

from engine.serving.engine_loop import EngineLoop
from engine.serving.observer import LoopObserver, LoopStats, NullObserver
from engine.serving.request_stream import (
    LoopClosed,
    QueueFull,
    RequestFailed,
    RequestStream,
    StepOutput,
)

__all__ = [
    "EngineLoop",
    "LoopClosed",
    "LoopObserver",
    "LoopStats",
    "NullObserver",
    "QueueFull",
    "RequestFailed",
    "RequestStream",
    "StepOutput",
]
