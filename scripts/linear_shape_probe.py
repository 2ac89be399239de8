"""Host time of an eager linear whose row count changes at every call against one that repeats
(cuBLAS picks a kernel per new shape), and of small copies from pageable memory (a diagnosis
tool for the GPU: the batch of a decode step changes as requests finish).

    PYTHONPATH=. python scripts/linear_shape_probe.py
"""

from __future__ import annotations

import time

import torch


def _host_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev = torch.device("cuda")
    w = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16)
    x = torch.randn(256, 768, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        torch.nn.functional.linear(x[:128], w)
    print(f"linear, 128 rows every call: {_host_us(lambda i: torch.nn.functional.linear(x[:128], w), 100):.1f} us")
    print(f"linear, a new row count each call: {_host_us(lambda i: torch.nn.functional.linear(x[: 255 - i], w), 100):.1f} us")
    print(f"linear, those row counts again: {_host_us(lambda i: torch.nn.functional.linear(x[: 255 - i], w), 100):.1f} us")
    dst = torch.zeros(256, dtype=torch.long, device=dev)
    host = list(range(128))
    print(f"pageable copy of 128 ints: {_host_us(lambda i: dst[:128].copy_(torch.tensor(host), non_blocking=True), 100):.1f} us")
    pinned = torch.zeros(128, dtype=torch.long, pin_memory=True)
    print(f"pinned copy of 128 ints: {_host_us(lambda i: dst[:128].copy_(pinned, non_blocking=True), 100):.1f} us")
    big = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    for label, fn in (("pageable", lambda i: dst[:128].copy_(torch.tensor(host), non_blocking=True)),
                      ("pinned", lambda i: dst[:128].copy_(pinned, non_blocking=True))):  # fmt: skip
        busy = big @ big  # ~1 ms of device work queued ahead of the copy
        t0 = time.perf_counter()
        fn(0)
        waited = (time.perf_counter() - t0) * 1e6
        del busy
        torch.cuda.synchronize()
        print(f"{label} copy behind ~1 ms of queued device work: {waited:.1f} us of host time")


if __name__ == "__main__":
    main()
