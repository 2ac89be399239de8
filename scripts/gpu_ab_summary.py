"""Adaptive speculation's paired speedup per run, temperature and batch size, side by side.

    python scripts/gpu_ab_summary.py RUN.json ...

Each file is one `mtpserve bench offline` result (scripts/gpu_ab.sh names them after the run).
Prints a Markdown table of the median speedup against the autoregressive baseline (and, in
brackets, the spread of the middle half of the paired rounds), then each run's decode steps per
arm at every point.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles (the values themselves below four rounds)."""
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    runs = {f.stem: json.loads(f.read_text()) for f in args.files}
    points = sorted({(r["temperature"], r["batch_size"]) for doc in runs.values() for r in doc["runs"]
                     if r["mode"] == "adaptive" and r.get("speedup_vs_ar") is not None})  # fmt: skip
    print("| run | " + " | ".join(f"T={t:g} b{b}" for t, b in points) + " |")
    print("|---|" + "---|" * len(points))
    for name, doc in runs.items():
        by_point = {(r["temperature"], r["batch_size"]): r for r in doc["runs"] if r["mode"] == "adaptive"}
        cells = []
        for point in points:
            r = by_point.get(point)
            if r is None or r.get("speedup_vs_ar") is None:
                cells.append("-")
                continue
            low, high = quartiles(r.get("round_speedups") or [r["speedup_vs_ar"]])
            cells.append(f"{r['speedup_vs_ar']:.2f} ({low:.2f}-{high:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, doc in runs.items():
        print(f"\n{name}: decode steps per arm")
        for r in doc["runs"]:
            if r["mode"] == "adaptive" and r.get("steps_per_arm"):
                arms = ", ".join(f"{arm} {n}" for arm, n in sorted(r["steps_per_arm"].items()))
                print(f"  T={r['temperature']:g} b{r['batch_size']}: {arms}")


if __name__ == "__main__":
    main()
