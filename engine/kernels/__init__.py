"""Triton kernels for the GPU fast path.

Modules here import Triton at import time; import them only after ``triton_available()``.
Their PyTorch references (the CPU path) live next to the code that uses them:
``engine/attention/reference.py`` and ``engine/kv/compaction.py``.
"""

from __future__ import annotations

import functools
import importlib.util

from torch import Tensor, is_grad_enabled


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def use_fused_kernels(x: Tensor) -> bool:
    """Inference on a CUDA tensor with Triton installed: the fused layer kernels apply.

    Training keeps the PyTorch path (the kernels have no backward).
    """
    return x.is_cuda and not is_grad_enabled() and triton_available()
