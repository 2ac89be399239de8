"""How long ``CUDAGraph.replay()`` holds the host, by what the device is doing (a diagnosis tool).

The H200 profiles of session 38 had ``cudaGraphLaunch`` at ~185 us of host time per
autoregressive step at batch 128 (one graph of ~170 kernels) and up to 1.4 ms for one launch of
a tree step's graph, while steps were launched ahead of their host work. A launch that waits for
the device takes back what launching ahead gives. This times the host side of ``replay()`` for
graphs of ``--nodes`` small kernels, each ``--kernel-us`` long on the device:

* ``idle``: the stream is empty;
* ``same-busy``: the same graph is still running (a step launched ahead of its predecessor);
* ``other-busy``: another graph of the same shape is running (double-buffered graphs);
* ``queue``: ``--depth`` graphs queued back to back, each launch timed.

    PYTHONPATH=. python scripts/graph_launch_probe.py OUT [--nodes 170,500] [--kernel-us 3]

Writes OUT/graph_launch_probe.json and prints one line per case (median and max us).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _graph(nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(nodes):
            x.mul_(1.0000001)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.mul_(1.0000001)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def probe(nodes: int, elems: int, repeats: int, depth: int) -> dict[str, object]:
    x = torch.ones(elems, device="cuda")
    y = torch.ones(elems, device="cuda")
    a, b = _graph(nodes, x), _graph(nodes, y)
    torch.cuda.synchronize()
    start = time.perf_counter()
    a.replay()
    torch.cuda.synchronize()
    device_us = (time.perf_counter() - start) * 1e6
    cases: dict[str, list[float]] = {"idle": [], "same-busy": [], "other-busy": []}
    for _ in range(repeats):
        torch.cuda.synchronize()
        cases["idle"].append(_timed(a.replay))
        cases["same-busy"].append(_timed(a.replay))  # a still running
        torch.cuda.synchronize()
        a.replay()
        cases["other-busy"].append(_timed(b.replay))  # a running, b launched
    torch.cuda.synchronize()
    queue = [_timed(a.replay if i % 2 else b.replay) for i in range(depth)]
    torch.cuda.synchronize()
    out: dict[str, object] = {"nodes": nodes, "elements": elems, "device_us_per_graph": round(device_us, 1)}
    for name, values in cases.items():
        out[name] = {"median_us": round(statistics.median(values), 1), "max_us": round(max(values), 1)}
    out["queue_us"] = [round(v, 1) for v in queue]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nodes", default="170,500")
    parser.add_argument("--elements", type=int, default=1 << 20, help="per kernel (sets its device time)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        row = probe(nodes, args.elements, args.repeats, args.depth)
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "graph_launch_probe.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
