"""The GPU's SM clock, and a spin that brings it up before a timed run.

An idle H200 sits at 345 MHz and boosts to 1980 MHz under load (read with ``nvidia-smi`` on the
device machines). A run that starts on a GPU left idle (the host between two runs: records,
collections, the next mode's set-up) does its first milliseconds (the prefill) at a fraction of
the clock; in session 23 prefills of 64 prompts took 35-95 ms in some rounds against 8-11 ms in
others. ``spin`` keeps the GPU busy with matrix products for a while right before a run, as a
GPU under steady load is; ``sm_clock_mhz`` reads the clock (NVML, through PyTorch) so that the
stall probe can record runs that began below it.
"""

from __future__ import annotations

import functools
import time

import torch


def sm_clock_mhz(device: torch.device) -> int | None:
    """The SM clock now (MHz), None off a CUDA GPU or without NVML."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # no pynvml / NVML in this process: no reading
        return None


@functools.cache
def max_sm_clock_mhz(device_index: int) -> int | None:
    """The SM clock's maximum (MHz), None without NVML."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler(device_index)  # type: ignore[attr-defined]
        return int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except Exception:
        return None


def below_boost(device: torch.device, mhz: int | None, fraction: float = 0.9) -> bool:
    """Whether ``mhz`` is under ``fraction`` of the device's maximum SM clock."""
    if mhz is None or device.type != "cuda":
        return False
    top = max_sm_clock_mhz(device.index or 0)
    return top is not None and mhz < fraction * top


@functools.cache
def _operands(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)  # [2048, 2048]
    return a, a.T.contiguous()


def spin(device: torch.device, ms: float) -> None:
    """Keep a CUDA GPU busy for ``ms`` milliseconds (2048^3 bf16 products, ~20 us each on an
    H200), then wait for it; a no-op elsewhere or for ``ms <= 0``."""
    if device.type != "cuda" or ms <= 0:
        return
    a, b = _operands(device)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(16):
            torch.mm(a, b)
        torch.cuda.synchronize(device)
