"""Launch settings of the tree-MLA attention kernel measured on a device, per call shape.

On a grid that does not fill the GPU (small batches: the batch-1 tree step's attention runs 18
times a step over grids of a few programs) a call's time is one program's latency, which depends
on the tile, the warps and the key splits in ways a rule of thumb can miss. A table file
(``tuned/tree_mla_attention.json`` beside this module, or the file ``MTPSERVE_ATTENTION_TUNING``
names) holds the fastest of a grid of settings for shapes the engine captures in its CUDA graphs,
as ``scripts/tune_attention.py`` measured them (graph replays at two context lengths, each
setting checked against the PyTorch reference first). A call whose shape is not in the table
keeps the kernel's rules (``default_tile``, ``_pick_num_splits``, ``_pack_heads``).

None is shipped: on the H200 at the ``gpu`` preset's sizes, the best settings of three batch-1
shapes took 2-8 µs off a tree step of 1.0 ms and an autoregressive step of 0.53 ms of device
time (``bench/results/h200-2026-12-03-session24-attention-tuning.json``), too little to keep a
table in step with the kernel for.

A table is for one device name and one model's attention sizes (heads, latent rank, rope
width).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

DEFAULT_TABLE = Path(__file__).with_name("tuned") / "tree_mla_attention.json"
ENV_VAR = "MTPSERVE_ATTENTION_TUNING"


class ShapeKey(NamedTuple):
    """What a captured call's best settings depend on, besides the device and model sizes."""

    num_seqs: int  # sequences of the call (the graph's batch bucket)
    max_new: int  # query tokens per sequence (new_mask's width)
    has_qctx: bool  # per-row committed contexts (the MTP drafting rows)


class TunedLaunch(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_splits: int
    pack_heads: bool


def table_path() -> Path:
    return Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else DEFAULT_TABLE


@functools.cache
def _load(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    doc = json.loads(p.read_text())
    return list(doc.get("tables", []))


def lookup(device_name: str, heads: int, rank: int, rope: int, key: ShapeKey) -> TunedLaunch | None:
    """The measured settings for ``key`` on ``device_name`` at these sizes, None if none."""
    return _lookup(str(table_path()), device_name, heads, rank, rope, key)


@functools.cache
def _lookup(path: str, device_name: str, heads: int, rank: int, rope: int, key: ShapeKey) -> TunedLaunch | None:
    for table in _load(path):
        if (table.get("device"), table.get("heads"), table.get("rank"), table.get("rope")) != (
            device_name, heads, rank, rope
        ):
            continue
        for entry in table.get("entries", []):
            if ShapeKey(entry["num_seqs"], entry["max_new"], bool(entry["has_qctx"])) == key:
                return TunedLaunch(**entry["launch"])
    return None


def clear_cache() -> None:
    """Forget loaded tables (after the file or ``MTPSERVE_ATTENTION_TUNING`` changed)."""
    _load.cache_clear()
    _lookup.cache_clear()
