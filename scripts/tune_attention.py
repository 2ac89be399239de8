"""Time the tree-MLA attention kernel's launch settings for the shapes an engine captures (a
diagnosis tool; GPU only). Its findings go into the kernel's rules (``default_tile``,
``_pick_num_splits``, ``_pack_heads`` in ``engine/kernels/tree_mla_attention.py``) when they are
worth it; nothing reads its output at run time.

1. the shapes: ``--shapes B:NEW:QCTX,...``, or those an adaptive engine over random weights of a
   training preset calls while it captures its CUDA graphs (``--max-batch``, default 16):
   sequences, query tokens per sequence, per-row contexts or not;
2. for each shape, smallest batches first while ``--budget-s`` lasts: the kernel's defaults and
   every setting of a grid (tile rows, keys per step, warps, key splits, packed or padded heads)
   on random inputs of that shape at each of ``--contexts``, checked against the PyTorch
   reference, then timed as the replay of a CUDA graph of ``CALLS_PER_GRAPH`` calls (as the
   engine runs it: no launch gaps). A shape's score is its mean over the contexts; the best
   is the fastest setting where it beats the defaults by ``--min-gain`` (default 3%);
3. writes every setting's time to OUT/attention_tuning.json.

Session 24 on the H200 (``bench/results/h200-2026-12-03-session24-attention-tuning.json``): of
tiles of 16/32/64 rows, 16/32 keys, 1-8 splits and either head layout, three batch-1 shapes ran
fastest with 16-row tiles, 16 keys and 8 splits, 8.5-10.5 -> 7.2-7.5 us a call alone; with those
settings in the captured steps, 2-8 us of a 1.0 ms tree step and a 0.53 ms autoregressive one.

    PYTHONPATH=. python scripts/tune_attention.py OUT [--shapes 1:33:0,1:4:1] [--budget-s 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench.gpu_kernels as gk  # noqa: E402
import engine.kernels.tree_mla_attention as attn  # noqa: E402
from scripts.random_weights import preset_config  # noqa: E402

CALLS_PER_GRAPH = 20


class ShapeKey(NamedTuple):
    """What a captured call's best settings depend on, besides the device and model sizes."""

    num_seqs: int  # sequences of the call (the graph's batch bucket)
    max_new: int  # query tokens per sequence (new_mask's width)
    has_qctx: bool  # per-row committed contexts (the MTP drafting rows)


class Launch(NamedTuple):
    """``tree_mla_attention``'s tuning knobs."""

    block_m: int
    block_n: int
    num_warps: int
    num_splits: int
    pack_heads: bool


class Grid(NamedTuple):
    """The requested settings (``--block-ms``, ``--block-ns``, ``--splits``); the default is the
    neighbourhood of session 24's batch-1 winners."""

    block_ms: tuple[int, ...] = (16, 64)
    block_ns: tuple[int, ...] = (16,)
    splits: tuple[int, ...] = (4, 8, 16)


def settings_grid(key: ShapeKey, heads: int, grid: Grid = Grid()) -> Iterator[Launch]:
    """Each distinct launch of ``grid`` for ``key`` (tile rows clamp to what a sequence's rows
    need, so several requested sizes can launch alike: each launch is listed once)."""
    seen = set()
    packs = (True,) if heads & (heads - 1) == 0 else (True, False)
    for pack in packs:
        stride = heads if pack else 1 << (heads - 1).bit_length()
        rows = key.max_new * stride
        for bm in grid.block_ms:
            eff = attn._rows_per_tile(bm, rows)
            for bn in grid.block_ns:
                for warps in (4, 8) if eff >= 64 else (4,):
                    for splits in grid.splits:
                        launch = Launch(eff, bn, warps, splits, pack)
                        if launch not in seen:
                            seen.add(launch)
                            yield launch


def pick(times: dict[str, float], default_key: str, min_gain: float) -> str:
    """The fastest setting's key, or ``default_key`` unless another beats it by ``min_gain``."""
    best = min(times, key=lambda k: times[k])
    return best if times[best] < (1.0 - min_gain) * times[default_key] else default_key


def graph_us(fn: Callable[[], Any]) -> float:
    """Microseconds per call of ``fn`` replayed ``CALLS_PER_GRAPH`` times in one CUDA graph."""
    return gk.graph_ms(fn, CALLS_PER_GRAPH) * 1e3


def inputs_for(key: ShapeKey, ctx: int, heads: int, seed: int, device: str = "cuda") -> dict[str, Any]:
    inputs = gk.build_attention_inputs(key.num_seqs, key.max_new, ctx, heads, seed=seed, device=device)
    if key.has_qctx:  # MTP rows: each sees the committed entries up to a few before the end
        gen = torch.Generator().manual_seed(seed)
        per_row = inputs["ctx_lens"].cpu().repeat_interleave(key.max_new)  # [N]
        less = torch.randint(0, 4, per_row.shape, generator=gen, dtype=per_row.dtype)
        inputs["query_ctx_lens"] = (per_row - less).clamp(min=0).to(torch.int32).to(device)
    return inputs


def tune_shape(key: ShapeKey, heads: int, contexts: list[int], grid: Grid = Grid(),
               device: str = "cuda") -> dict[str, Any]:
    """Every setting's mean time over ``contexts`` (µs), wrong or failing ones left out."""
    per_ctx: dict[str, list[float]] = {}
    settings = {"default": {}} | {
        json.dumps(s._asdict()): s._asdict() for s in settings_grid(key, heads, grid)
    }
    errors: dict[str, str] = {}
    for ctx in contexts:
        inputs = inputs_for(key, ctx, heads, seed=key.num_seqs * 131 + key.max_new + ctx, device=device)
        ref = gk.attention_reference(**inputs).float()
        for name, kw in settings.items():
            if name in errors:
                continue
            try:
                got = attn.tree_mla_attention(**inputs, **kw).float()
                if not bool(((got - ref).abs() <= 2e-2 + 2e-2 * ref.abs()).all()):
                    errors[name] = "differs from the reference"
                    continue
                per_ctx.setdefault(name, []).append(graph_us(partial(attn.tree_mla_attention, **inputs, **kw)))
            except Exception as exc:  # e.g. out of shared memory or registers
                errors[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
    times = {k: statistics.mean(v) for k, v in per_ctx.items() if len(v) == len(contexts)}
    return {"times": times, "errors": errors}


def record_shapes(preset: str, max_batch: int) -> tuple[Any, Counter[ShapeKey]]:
    """A random-weight adaptive engine, and the attention shapes it called while capturing."""
    from spec_step_profile import random_adaptive_engine

    seen: Counter[ShapeKey] = Counter()
    kernel = attn.tree_mla_attention

    def recording(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                  block_tables: torch.Tensor, ctx_lens: torch.Tensor, query_start: torch.Tensor,
                  new_mask: torch.Tensor, scale: float, query_ctx_lens: torch.Tensor | None = None,
                  **kw: Any) -> torch.Tensor:  # fmt: skip
        seen[ShapeKey(block_tables.shape[0], new_mask.shape[1], query_ctx_lens is not None)] += 1
        return kernel(q_latent, q_rope, kv_cache, block_tables, ctx_lens, query_start, new_mask,
                      scale, query_ctx_lens, **kw)

    attn.tree_mla_attention = recording  # type: ignore[assignment]
    try:
        eng = random_adaptive_engine(preset, torch.device("cuda"), max_batch)
    finally:
        attn.tree_mla_attention = kernel  # type: ignore[assignment]
    return eng, seen


def _ints(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",")) if text else ()


def parse_shapes(text: str) -> list[ShapeKey]:
    """``B:NEW:QCTX`` items, e.g. ``1:33:0,1:4:1``."""
    keys = []
    for item in text.split(","):
        b, new, qctx = (int(x) for x in item.split(":"))
        keys.append(ShapeKey(b, new, bool(qctx)))
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--contexts", default="64,256")
    parser.add_argument("--budget-s", type=float, default=200.0, help="seconds for the timing")
    parser.add_argument("--min-gain", type=float, default=0.03)
    parser.add_argument("--shapes", default=None,
                        help="B:NEW:QCTX,... (QCTX 0/1) to time without building an engine to record them")
    parser.add_argument("--block-ms", default=None, help="tile rows of the grid, e.g. 16,32,64")
    parser.add_argument("--block-ns", default=None, help="keys per step of the grid, e.g. 16,32")
    parser.add_argument("--splits", default=None, help="key splits of the grid, e.g. 1,2,4,8")
    args = parser.parse_args()
    default = Grid()
    grid = Grid(_ints(args.block_ms) or default.block_ms, _ints(args.block_ns) or default.block_ns,
                _ints(args.splits) or default.splits)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = preset_config(args.preset)
    heads, rank, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    contexts = [int(c) for c in args.contexts.split(",")]
    gk.RANK, gk.ROPE, gk.BLOCK_SIZE = rank, rope, 16  # the engine's page
    if args.shapes:
        seen = Counter(parse_shapes(args.shapes))
    else:
        t0 = time.perf_counter()
        eng, seen = record_shapes(args.preset, args.max_batch)
        gk.BLOCK_SIZE = eng.pool.block_size
        print(f"engine built in {time.perf_counter() - t0:.0f} s; shapes: {dict(seen)}", flush=True)
        del eng
        torch.cuda.empty_cache()
    report: dict[str, Any] = {"preset": args.preset, "device": torch.cuda.get_device_name(0),
                              "contexts": contexts, "grid": grid._asdict(), "shapes": []}
    start = time.perf_counter()
    for key in sorted(seen, key=lambda k: (k.num_seqs, k.max_new, k.has_qctx)):
        if time.perf_counter() - start > args.budget_s:
            print(f"budget spent: {key} and later shapes not timed", flush=True)
            break
        result = tune_shape(key, heads, contexts, grid)
        times = result["times"]
        if "default" not in times:
            print(f"{key}: the defaults failed ({result['errors'].get('default')})", flush=True)
            continue
        best = pick(times, "default", args.min_gain)
        print(f"{key}: default {times['default']:.2f} us, best {times[best]:.2f} us {best} "
              f"({len(times)} settings, {len(result['errors'])} failed)", flush=True)
        report["shapes"].append({**key._asdict(), **result, "best": best})
        (args.out / "attention_tuning.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
