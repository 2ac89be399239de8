"""The fixed tree (``TOPKxDEPTH-N``) with the highest median speedup over autoregressive decoding
at batch 1, greedy, in an offline benchmark's JSON (``scripts/gpu_default_tree.sh``).

    python scripts/fastest_shape.py RESULTS.json   # prints e.g. 4x4-32
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fastest_shape(doc: dict) -> str:
    runs = [
        r
        for r in doc["runs"]
        if r["mode"] == "tree" and r["batch_size"] == 1 and r["temperature"] == 0.0
        and not r.get("skipped") and "x" in r["label"]
    ]  # fmt: skip
    if not runs:
        raise ValueError("no fixed TOPKxDEPTH-N tree was timed at batch 1, T=0")
    return str(max(runs, key=lambda r: r["speedup_vs_ar"])["label"].removeprefix("tree-"))


if __name__ == "__main__":
    print(fastest_shape(json.loads(Path(sys.argv[1]).read_text())))
