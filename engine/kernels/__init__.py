"""Triton kernels for the GPU fast path.

Modules here import Triton at import time; import them only after ``triton_available()``.
Their PyTorch references (the CPU path) live next to the code that uses them:
``engine/attention/reference.py`` and ``engine/kv/compaction.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import TypeVar

from torch import Tensor, is_grad_enabled

T = TypeVar("T")
_FAILED: dict[str, str] = {}  # kernels that failed to build or launch -> the error


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def use_fused_kernels(x: Tensor) -> bool:
    """Inference on a CUDA tensor with Triton installed: the fused layer kernels apply.

    Training keeps the PyTorch path (the kernels have no backward).
    """
    return x.is_cuda and not is_grad_enabled() and triton_available()


def run_kernel(name: str, launch: Callable[[], T]) -> T | None:
    """``launch()`` a Triton kernel; if it fails to build or launch, warn once and return None
    from then on, so the caller takes its PyTorch path (same results, more launches)."""
    if name in _FAILED:
        return None
    try:
        return launch()
    except Exception as exc:  # noqa: BLE001 - any build/launch failure: fall back
        _FAILED[name] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"Triton kernel {name} failed, using the PyTorch path: {_FAILED[name]}",
                      stacklevel=3)  # fmt: skip
        return None
