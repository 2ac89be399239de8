"""``bench.stall_probe``: what happened during a run is counted, and nothing else is.

The Triton hooks are driven here the way Triton's JIT calls them around a build (a CPU has no
Triton backend to build with); on a GPU a real kernel build is counted."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from bench.stall_probe import StallProbe, describe, stall_text

knobs = pytest.importorskip("triton").knobs


def test_a_collection_is_counted_with_its_pause() -> None:
    with StallProbe() as probe:
        before = probe.snapshot()
        assert probe.since(before) == {}
        gc.collect()
        delta = probe.since(before)
    assert delta["gc_collections"] >= 1 and delta["gc_max_ms"] <= delta["gc_ms"]
    assert describe(delta).startswith(f"gc {delta['gc_collections']}/")
    assert gc.callbacks.count(probe._on_gc) == 0  # closed: uninstalled


def test_triton_builds_are_counted_and_earlier_hooks_still_run() -> None:
    calls: list[str] = []
    orig = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = lambda **kw: calls.append("pre")
    knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append("post")
    prev = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    try:
        with StallProbe() as probe:
            before = probe.snapshot()

            class Fn:
                name = "_my_kernel"

            kwargs: dict[str, Any] = {"key": "k", "repr": "r", "fn": Fn(), "compile": {},
                                      "is_manual_warmup": False, "already_compiled": False}
            for _ in range(2):  # Triton: the pre hook, the build, the post hook
                assert not knobs.runtime.jit_cache_hook(**kwargs)  # a true result would skip the build
                knobs.runtime.jit_post_compile_hook(**kwargs)
            delta = probe.since(before)
        assert delta["triton_builds"] == 2 and delta["triton_ms"] >= 0
        assert delta["triton_kernels"] == ["_my_kernel"]
        assert calls == ["pre", "post", "pre", "post"]
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == prev  # restored
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = orig


def test_a_run_begun_below_the_boost_clock_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML is read through ``bench.gpu_clock``; here its readings are given: 345 MHz at the
    start of the first run (an idle H200), 1980 (the maximum) around the second."""
    import bench.gpu_clock
    import bench.stall_probe

    readings = iter([345, 1900, 1980, 1980])
    monkeypatch.setattr(bench.stall_probe, "sm_clock_mhz", lambda device: next(readings))
    monkeypatch.setattr(bench.gpu_clock, "max_sm_clock_mhz", lambda index: 1980)
    probe = StallProbe("cuda")  # no allocator statistics before CUDA is initialised
    first = probe.since(probe.snapshot())
    assert first == {"sm_mhz_start": 345, "sm_mhz_end": 1900}
    assert describe(first) == "clock 345->1900MHz"
    assert probe.since(probe.snapshot()) == {}  # at the boost clock: nothing to record


def test_no_clock_off_a_gpu_and_the_spin_is_a_no_op_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.gpu_clock import below_boost, sm_clock_mhz, spin

    products: list[object] = []
    monkeypatch.setattr(torch, "mm", lambda *a, **k: products.append(a))
    cpu = torch.device("cpu")
    assert sm_clock_mhz(cpu) is None and not below_boost(cpu, 345)
    spin(cpu, 50.0)
    assert products == []  # nothing to keep busy: no product ran
    assert StallProbe().snapshot()["sm_mhz"] is None


def test_stall_text_of_a_record() -> None:
    assert stall_text({"warmup_stalls": {}, "stalls": [{}, {}]}) == ""
    text = stall_text({"warmup_stalls": {"triton_builds": 3, "triton_ms": 80.0},
                       "stalls": [{}, {"gc_collections": 1, "gc_ms": 35.0, "device_allocs": 2}]})
    assert text == "warm-up: triton 3/80.0ms | - | gc 1/35.0ms alloc 2"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_kernel_build_and_allocation_on_a_gpu() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_fill_kernel(out_ptr, n, value: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, value, mask=offs < n)

    with StallProbe("cuda") as probe:
        before = probe.snapshot()
        out = torch.empty(1 << 26, device="cuda")  # 256 MiB: a new segment
        _probe_fill_kernel[(1,)](out, 16, value=3.0, BLOCK=16)
        torch.cuda.synchronize()
        delta = probe.since(before)
    assert delta["triton_builds"] == 1 and delta["triton_kernels"] == ["_probe_fill_kernel"]
    assert delta["device_allocs"] >= 1
    from bench.gpu_clock import max_sm_clock_mhz, sm_clock_mhz, spin

    spin(torch.device("cuda"), 20.0)
    assert sm_clock_mhz(torch.device("cuda")) is not None and max_sm_clock_mhz(0) is not None  # NVML reads
