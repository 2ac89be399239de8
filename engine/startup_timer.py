"""Where an engine's start-up goes: seconds per stage (weights, KV pool, CUDA graphs, calibrations).

On a GPU most of an engine's start-up is capturing CUDA graphs (the autoregressive and prefill
shapes, the MTP catch-up shapes, two tree steps per captured budget, each over nine batch
buckets) and the adaptive controller's calibrations; ``LLMEngine.startup_seconds`` keeps the
breakdown and the log prints it, so that a slow start names its stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)


class StartupTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` (its device work included; repeated names add up)."""
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        logger.info("start-up: %s took %.2f s", name, elapsed)
