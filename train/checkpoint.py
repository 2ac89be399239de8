"""Resumable training checkpoints: one ``last.pt`` in the run's work folder, written atomically.

It holds the model, the optimiser of the current phase, the trainer's progress (phase, steps,
elapsed time, data position, history), the best weights so far and the RNG states. Batches are a
pure function of the data position (see ``WindowSampler``), so a resumed run reads exactly the
windows the interrupted one would have read next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "last.pt"


def save_checkpoint(folder: Path, payload: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHECKPOINT_NAME
    tmp = path.with_suffix(".tmp")
    payload = dict(payload)
    payload["rng_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        payload["rng_cuda"] = torch.cuda.get_rng_state_all()
    torch.save(payload, tmp)
    tmp.replace(path)
    return path


def load_checkpoint(folder: Path, device: torch.device) -> dict[str, Any] | None:
    path = folder / CHECKPOINT_NAME
    if not path.is_file():
        return None
    payload: dict[str, Any] = torch.load(path, map_location=device, weights_only=False)
    torch.set_rng_state(payload.pop("rng_cpu").cpu())
    rng_cuda = payload.pop("rng_cuda", None)
    if rng_cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng_cuda])
    return payload
