"""Counters of what can stall a timed step, so a slow round can be told apart from a slow engine.

Three suspects, each counted for the whole process while the probe is installed:

- **garbage collections** (``gc.callbacks``): how many ran and how long they paused, by the
  wall clock between their start and stop callbacks;
- **Triton kernel variants built** (``triton.knobs.runtime`` JIT hooks, where this Triton has
  them): the first use of a variant in a process compiles it or loads it from the disk cache,
  which takes tens of milliseconds even when the cache is warm;
- **device allocations of the CUDA caching allocator** (``torch.cuda.memory_stats``): a
  ``cudaMalloc`` and, where memory ran short, a retry that frees cached blocks first (it
  synchronizes the device);
- **a GPU below its boost clock** (``bench.gpu_clock``): the SM clock when the run began and
  when it ended, recorded where it was under 90% of the maximum (an idle H200 sits at 345 of
  1980 MHz, and a run begun there starts slow).

``snapshot()`` returns the running totals; ``since(earlier)`` the part of them after an earlier
snapshot, with the zero counters left out, so an uneventful run records ``{}``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from bench.gpu_clock import below_boost, sm_clock_mhz

MAX_NAMES = 8  # kernel names kept per delta (the first ones built)


class StallProbe:
    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.gc_pauses_ms: list[float] = []  # every collection's pause, in order
        self.triton_ms = 0.0
        self.triton_names: list[str] = []  # the kernel of every variant built, in order
        self._gc_start: float | None = None
        self._triton_start: list[float] = []
        self._knobs: Any = None
        self._prev_hooks: tuple[Any, Any] = (None, None)
        self._installed = False

    # ---- installation ----
    def install(self) -> StallProbe:
        if self._installed:
            return self
        gc.callbacks.append(self._on_gc)
        self._install_triton()
        self._installed = True
        return self

    def close(self) -> None:
        if not self._installed:
            return
        gc.callbacks.remove(self._on_gc)
        if self._knobs is not None:
            self._knobs.runtime.jit_cache_hook, self._knobs.runtime.jit_post_compile_hook = self._prev_hooks
            self._knobs = None
        self._installed = False

    def __enter__(self) -> StallProbe:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _install_triton(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without the JIT hooks (before 3.4)
            return
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return
        prev_pre, prev_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def before_build(**kwargs: Any) -> Any:
            self._triton_start.append(time.perf_counter())
            # a true result would skip the build: only an earlier hook may ask for that
            return prev_pre(**kwargs) if prev_pre is not None else None

        def after_build(**kwargs: Any) -> Any:
            if self._triton_start:  # (an asynchronous build ends out of order: not timed)
                self.triton_ms += (time.perf_counter() - self._triton_start.pop()) * 1e3
            fn = kwargs.get("fn")
            self.triton_names.append(str(getattr(fn, "name", fn)))
            return prev_post(**kwargs) if prev_post is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before_build, after_build
        self._knobs, self._prev_hooks = knobs, (prev_pre, prev_post)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_pauses_ms.append((time.perf_counter() - self._gc_start) * 1e3)
            self._gc_start = None

    # ---- reading ----
    def _allocator(self) -> tuple[int, int]:
        """(device allocations, allocation retries) of the CUDA caching allocator so far."""
        if self.device.type != "cuda" or not torch.cuda.is_initialized():
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        allocs = stats.get("num_device_alloc", stats.get("segment.all.allocated", 0))
        return int(allocs), int(stats.get("num_alloc_retries", 0))

    def snapshot(self) -> dict[str, Any]:
        allocs, retries = self._allocator()
        return {
            "gc_collections": len(self.gc_pauses_ms),
            "triton_builds": len(self.triton_names), "triton_ms": self.triton_ms,
            "device_allocs": allocs, "alloc_retries": retries,
            "sm_mhz": sm_clock_mhz(self.device),
        }

    def since(self, earlier: dict[str, Any]) -> dict[str, Any]:
        """What happened after ``earlier`` (a ``snapshot()``): non-zero counters only."""
        now = self.snapshot()
        out: dict[str, Any] = {}
        for key in ("gc_collections", "triton_builds", "triton_ms", "device_allocs", "alloc_retries"):
            delta = now[key] - earlier[key]
            if delta:
                out[key] = round(delta, 2) if isinstance(delta, float) else delta
        pauses = self.gc_pauses_ms[earlier["gc_collections"]:]
        if pauses:
            out["gc_ms"], out["gc_max_ms"] = round(sum(pauses), 2), round(max(pauses), 2)
        if "triton_builds" in out:
            out["triton_kernels"] = sorted(set(self.triton_names[earlier["triton_builds"]:]))[:MAX_NAMES]
        start, end = earlier.get("sm_mhz"), now["sm_mhz"]
        if below_boost(self.device, start) or below_boost(self.device, end):
            out["sm_mhz_start"], out["sm_mhz_end"] = start, end
        return out


def describe(delta: dict[str, Any]) -> str:
    """A short text of ``since()``'s result, e.g. ``gc 2/31.5ms triton 3/84.0ms alloc 1``;
    empty when nothing happened."""
    parts = []
    if delta.get("gc_collections"):
        parts.append(f"gc {delta['gc_collections']}/{delta.get('gc_ms', 0.0):.1f}ms")
    if delta.get("triton_builds"):
        parts.append(f"triton {delta['triton_builds']}/{delta.get('triton_ms', 0.0):.1f}ms")
    if delta.get("device_allocs"):
        parts.append(f"alloc {delta['device_allocs']}")
    if delta.get("alloc_retries"):
        parts.append(f"retry {delta['alloc_retries']}")
    if "sm_mhz_start" in delta:
        parts.append(f"clock {delta['sm_mhz_start']}->{delta['sm_mhz_end']}MHz")
    return " ".join(parts)


def stall_text(rec: dict[str, Any]) -> str:
    """A record's stall counters, warm-up first, rounds after ``|``:
    ``warm-up: triton 12/850.0ms | - | gc 1/35.2ms | -``; empty when every run was uneventful."""
    warmup, rounds = rec.get("warmup_stalls") or {}, rec.get("stalls") or []
    if not warmup and not any(rounds):
        return ""
    return " | ".join([f"warm-up: {describe(warmup) or '-'}"] + [describe(r) or "-" for r in rounds])
