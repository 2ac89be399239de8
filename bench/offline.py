"""``mtpserve bench offline``: every mode on one model folder, side by side, in one run.

Order of work: load the weights once; build the contenders (engine modes sharing the weights,
transformers on the same folder); check greedy tokens of every mode against ``ar`` (before any
timing; an engine mode that differs is not timed); then for each temperature and batch size warm
every contender up and run ``repeats`` rounds in which the modes alternate (each round starting
at the next mode, the heap collected before each run), so that load drifts of a shared machine
hit all modes alike. On GPU also measure copy bandwidth and matmul rate and
report each step against its floor (``bench.floor``).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from bench.check import compare_tokens, describe
from bench.contenders import Contender, build_contenders, load_base
from bench.engine_run import BatchRun
from bench.floor import measure_rates, step_floor
from bench.gpu_clock import max_sm_clock_mhz, sm_clock_mhz, spin
from bench.meta import run_metadata
from bench.modes import build_modes
from bench.prompts import batch_of, load_prompts
from bench.records import add_costs, add_speedups, calibration_rows, empty_record, make_record
from bench.stall_probe import StallProbe, stall_text
from engine.gc_tuning import settle_heap
from engine.model.loader import parse_dtype


@dataclass
class OfflineSettings:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    check_dtype: str | None = None  # None: the timing dtype; "none": no check
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    max_new_tokens: int = 64
    prompt_tokens: int = 64
    # None: the largest batch size, or min_sequences if more (a batch-1-only run with
    # min_sequences 16 decodes 16 prompts, not one prompt 16 times)
    num_prompts: int | None = None
    # Held-out prompts skipped first: a run on prompts a default sweep (up to 256) does not use.
    prompt_offset: int = 0
    modes: list[str] = field(default_factory=lambda: ["chain", "tree", "adaptive", "transformers",
                                                      "transformers-mtp"])
    # Draft tokens (default shape) or TOPKxDEPTH-N shapes per tree mode; empty: the default tree.
    tree_budgets: list[int | str] = field(default_factory=list)
    adaptive_tree: str | None = None  # TOPKxDEPTH-N: the adaptive mode's tree arm (None: default)
    adaptive_chains: list[int] | None = None  # depths of the adaptive mode's chain arms (None: default)
    repeats: int = 3
    # Small batches run more rounds, so that every point decodes at least this many prompts (a
    # batch-1 point of 3 rounds measures 3 prompts' acceptance, a batch-16 point 48).
    min_sequences: int = 0
    warmup_tokens: int = 8  # 0: max_new_tokens
    check_batch: int | None = None  # None: the largest batch size
    check_tokens: int | None = None  # None: max_new_tokens
    kv_memory_mb: int | None = None
    time_limit_s: float | None = None
    price_per_hour: float | None = None
    seed: int = 1000
    # Milliseconds of matrix products on the GPU right before every run (warm-up included), so
    # that each begins at the boost clock a GPU under load keeps (``bench.gpu_clock``); 0: none.
    spin_ms: float = 0.0
    # Once the timed engines are built, keep the cyclic GC off every object alive and collect
    # young objects less often (``engine.gc_tuning``, as the server does): for a process that
    # runs one sweep (the CLI), not for a test session.
    freeze_gc: bool = False
    # Every engine's ``EngineConfig.overlap_steps``, the baseline's included (None: on CUDA).
    overlap_steps: bool | None = None
    # Every engine's ``EngineConfig.prefill_chunk_tokens`` (None: the engine's default per device).
    prefill_chunk_tokens: int | None = None
    # ``EngineConfig.drafting_layer`` of the speculative engines (None: on CUDA in 16 bits).
    drafting_layer: bool | None = None
    # Every engine's ``EngineConfig.launch_after_prefill``, the baseline's included.
    launch_after_prefill: bool = True
    # Every engine's ``EngineConfig.early_catch_up``.
    early_catch_up: bool = True


def _log(msg: str) -> None:
    tqdm.write(msg)


def greedy_check(contenders: list[Contender], prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Greedy tokens of every contender against the ``ar`` contender's."""
    reference = contenders[0].run(prompts, tokens, 0.0, seed=0).tokens
    results: dict[str, Any] = {}
    for c in contenders[1:]:
        batch = prompts[:1] if c.skip_reason(len(prompts)) else prompts
        try:
            got = c.run(batch, tokens, 0.0, seed=0).tokens
        except Exception as exc:
            results[c.mode.label] = {"match": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            _log(f"check {c.mode.label}: ERROR {results[c.mode.label]['error']}")
            continue
        results[c.mode.label] = compare_tokens(reference[: len(batch)], got)
        _log(f"check {c.mode.label} vs ar: {describe(results[c.mode.label])}")
    return results


def _check_in_other_dtype(s: OfflineSettings, prompts: list[list[int]], modes: list) -> dict[str, Any]:
    """``greedy_check`` on engines built in ``s.check_dtype`` for the check's batch only: their
    CUDA graphs are captured for its buckets, not the sweep's (on the H200 the float32 engines
    for 256 took most of a sweep's start-up, to check a batch of 8). Otherwise configured as
    the timed engines are (steps launched ahead or not, the prefill chunk), so the check covers
    the paths the timed runs take."""
    assert s.check_dtype is not None
    base = load_base(s.model, s.device, s.check_dtype, len(prompts), s.prompt_tokens + s.max_new_tokens, None,
                     s.overlap_steps, s.prefill_chunk_tokens, s.drafting_layer, s.launch_after_prefill,
                     s.early_catch_up)
    contenders, _ = build_contenders(s.model, base, modes, parse_dtype(s.check_dtype))
    result = greedy_check(contenders, prompts, s.check_tokens or s.max_new_tokens)
    del base, contenders
    gc.collect()
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def _floor_fields(c: Contender, rec: dict[str, Any], base_model: Any, rates: dict[str, float],
                  s: OfflineSettings, dtype_bytes: int) -> None:
    step_ms = rec["step_ms"] if c.engine is not None else rec["tpot_ms"]
    if step_ms is None or c.mode.mode == "transformers-mtp":
        return
    per_seq = 1.0 + (rec["draft_tokens_per_step"] or 0.0)
    depth = c.engine.budget.depth if c.engine is not None and per_seq > 1 else 0
    floor = step_floor(base_model, rates, rec["batch_size"], per_seq, float(depth),
                       s.prompt_tokens + s.max_new_tokens // 2, dtype_bytes)
    rec["floor"] = floor
    rec["step_over_floor"] = step_ms / floor["floor_ms"]


def rounds_at(s: OfflineSettings, bs: int) -> int:
    """Timed rounds at batch size ``bs``: ``repeats``, or more where that many rounds would
    decode fewer than ``min_sequences`` prompts."""
    return max(s.repeats, -(-s.min_sequences // bs))


def _time_point(
    s: OfflineSettings, contenders: list[Contender], skipped: dict[str, str],
    pool: list[list[int]], bs: int, temperature: float, deadline: float | None, bar: tqdm,
    probe: StallProbe,
) -> list[dict[str, Any]]:
    """Records of one (temperature, batch size) point: a warm-up round, then timed rounds in
    which the modes alternate. Each timed round takes the next ``bs`` prompts of the pool (all
    modes of a round the same ones), so small batches see several prompts, not one. Past
    ``deadline`` no further run starts; only complete rounds count, and a mode left without
    one is recorded as skipped. Each run's stall counters (``StallProbe``: collections, Triton
    builds, device allocations during it) go into the record: ``warmup_stalls``, and
    ``stalls`` with one entry per timed round."""
    late = f"time limit of {s.time_limit_s or 0:.0f} s reached"
    records: list[dict[str, Any]] = []
    runs: dict[str, list[BatchRun]] = {}
    stalls: dict[str, list[dict[str, Any]]] = {}  # per mode: the warm-up's, then each round's
    active = []
    for c in contenders:
        reason = c.skip_reason(bs) or skipped.get(c.mode.label)
        if reason:
            records.append(empty_record(c.mode.mode, c.mode.label, bs, temperature, reason))
        else:
            active.append(c)
            runs[c.mode.label] = []
            stalls[c.mode.label] = []
    rounds = 0
    for rep in range(-1, rounds_at(s, bs)):  # round -1: warm-up
        bar.set_postfix_str(f"T={temperature} bs={bs}" + (" warm-up" if rep < 0 else ""))
        if deadline is not None and time.monotonic() > deadline:
            break
        prompts = batch_of(pool[(max(rep, 0) * bs) % len(pool) :] + pool, bs)
        # Each round starts at the next mode: a mode's round never always follows the same other
        # mode's (whose garbage, allocator and clock state it would inherit).
        shift = max(rep, 0) % max(len(active), 1)
        for c in active[shift:] + active[:shift]:
            if deadline is not None and time.monotonic() > deadline:
                break
            tokens = (s.warmup_tokens or s.max_new_tokens) if rep < 0 else s.max_new_tokens
            spin(torch.device(s.device), s.spin_ms)
            before = probe.snapshot()
            try:
                run = c.run(prompts, tokens, temperature, seed=s.seed + max(rep, 0))
            except Exception as exc:  # a mode that breaks mid-sweep is reported, not fatal
                skipped[c.mode.label] = f"{type(exc).__name__}: {exc}"[:300]
                _log(f"mode {c.mode.label} failed at T={temperature} bs={bs}: {skipped[c.mode.label]}")
                active.remove(c)
                records.append(empty_record(c.mode.mode, c.mode.label, bs, temperature,
                                            skipped[c.mode.label]))
                continue
            stalls[c.mode.label].append(probe.since(before))
            if rep >= 0:
                runs[c.mode.label].append(run)
        else:
            rounds += rep >= 0
            bar.update(rep >= 0)
            continue
        break  # the deadline passed inside the round
    ar_runs = runs.get("ar", [])[:rounds]
    for c in active:
        done = runs[c.mode.label][:rounds]
        if not done:
            records.append(empty_record(c.mode.mode, c.mode.label, bs, temperature, late))
            continue
        rec = make_record(c.mode.mode, c.mode.label, bs, temperature, done)
        rec["warmup_stalls"], rec["stalls"] = stalls[c.mode.label][0], stalls[c.mode.label][1 : rounds + 1]
        if ar_runs:
            add_speedups(rec, done, ar_runs)
            if temperature == 0.0:
                rec["greedy_match"] = done[0].tokens == ar_runs[0].tokens
        records.append(rec)
    return records


def run_offline(s: OfflineSettings, progress: bool = True) -> tuple[dict[str, Any], bool]:
    """Run the sweep; returns the results document and whether every check passed."""
    t_start = time.monotonic()
    max_batch = max(s.batch_sizes)
    meta = run_metadata(s.device, s.model)
    base = load_base(s.model, s.device, s.dtype, max_batch, s.prompt_tokens + s.max_new_tokens,
                     s.kv_memory_mb, s.overlap_steps, s.prefill_chunk_tokens, s.drafting_layer,
                     s.launch_after_prefill, s.early_catch_up)
    prompts, source = load_prompts(s.model, base.tokenizer, base.model_config.vocab_size,
                                   s.num_prompts or max(max_batch, s.min_sequences), s.prompt_tokens,
                                   skip=s.prompt_offset)
    modes = build_modes(s.modes, s.tree_budgets, s.adaptive_tree, s.adaptive_chains)
    contenders, skipped = build_contenders(s.model, base, modes, parse_dtype(s.dtype))
    # Progress in the log, so that a run cut off by its time limit shows which stage it was in.
    for c in contenders:
        if c.engine is not None:
            _log(f"built {c.mode.label} in {sum(c.engine.startup_seconds.values()):.1f} s "
                 f"({time.monotonic() - t_start:.0f} s since the start)")
    if s.freeze_gc:
        settle_heap()
    for label, reason in skipped.items():
        _log(f"mode {label}: skipped ({reason})")

    check_prompts = batch_of(prompts, s.check_batch or max_batch)
    if s.check_dtype == "none":
        check = {}  # skipped on request: the report says so
    elif s.check_dtype and s.check_dtype != s.dtype:
        check = _check_in_other_dtype(s, check_prompts, modes)
    else:
        check = greedy_check(contenders, check_prompts, s.check_tokens or s.max_new_tokens)
    _log(f"greedy check done ({time.monotonic() - t_start:.0f} s since the start)")
    ok = True
    for c in list(contenders):
        res = check.get(c.mode.label)
        if c.engine is not None and res is not None and not res["match"]:
            skipped[c.mode.label] = f"greedy output differs from ar: {res.get('error') or describe(res)}"
            contenders.remove(c)
            ok = False

    # In float32 every timed greedy run must equal ar too; in bf16 the verify and decode shapes
    # round differently, so there the check above (in --check-dtype) is the lossless check and
    # the timed runs' agreement is recorded for information.
    strict = parse_dtype(s.dtype) == torch.float32
    rates = measure_rates(s.device) if s.device.startswith("cuda") else None
    if rates is not None:
        device = torch.device(s.device)
        _log(f"SM clock {sm_clock_mhz(device)} MHz (maximum {max_sm_clock_mhz(device.index or 0)}) "
             f"after the rates' measurement; {s.spin_ms:g} ms of spin before every run")
    dtype_bytes = parse_dtype(s.dtype).itemsize
    records: list[dict[str, Any]] = []
    # All batch sizes of one temperature first: a time limit then cuts the sampled tail.
    points = [(t, b) for t in s.temperatures for b in s.batch_sizes]
    bar = tqdm(total=sum(rounds_at(s, b) for _, b in points), disable=not progress, desc="offline", unit="round")
    deadline = None if s.time_limit_s is None else t_start + s.time_limit_s
    with StallProbe(s.device) as probe:
        for temperature, bs in points:
            recs = _time_point(s, contenders, skipped, prompts, bs, temperature, deadline, bar, probe)
            for rec in recs:
                c = next((c for c in contenders if c.mode.label == rec["label"]), None)
                if rec["greedy_match"] is False and strict and c is not None and c.engine is not None:
                    ok = False
                if rates is not None and c is not None and not rec["skipped"]:
                    _floor_fields(c, rec, base.model, rates, s, dtype_bytes)
                if not rec["skipped"]:
                    _log(_one_line(rec))
            records += recs
    bar.close()
    if s.price_per_hour is not None:
        add_costs(records, s.price_per_hour)
    result = {
        **meta,
        # the effective values
        "settings": {**asdict(s), "overlap_steps": base.overlap_steps,
                     "prefill_chunk_tokens": base.scheduler.prefill_chunk_tokens},
        "prompts": source,
        "num_prompts": len(prompts),
        "modes": [m.label for m in modes],
        "skipped_modes": skipped,
        "check": check,
        "check_passed": ok,
        "check_dtype": s.check_dtype or s.dtype,
        "greedy_match_strict": strict,
        "device_rates": rates,
        # Each engine's build (the weights are loaded once, before): seconds per stage.
        "startup_s": {c.mode.label: {k: round(v, 3) for k, v in c.engine.startup_seconds.items()}
                      for c in contenders if c.engine is not None},  # fmt: skip
        # Adaptive engines' start-up calibration: each captured arm's step at each batch size.
        "arm_calibration": {c.mode.label: calibration_rows(c.engine) for c in contenders
                            if c.engine is not None and calibration_rows(c.engine)},  # fmt: skip
        "runs": records,
        "wall_s": round(time.monotonic() - t_start, 1),
        "loadavg_end": list(os.getloadavg()),
    }
    return result, ok


def _one_line(rec: dict[str, Any]) -> str:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    return (f"{rec['label']:<16} T={rec['temperature']:<4} bs={rec['batch_size']:<4} "
            f"tok/s={f(rec['tokens_per_s'], '.1f')} tpot={f(rec['tpot_ms'], '.1f')}ms "
            f"acc_len={f(rec['mean_accepted_length'], '.2f')} "
            f"speedup={f(rec['speedup_vs_ar'], '.2f')} rollback={f(rec['rollback_ms_per_step'], '.3f')}ms"
            + (f" step/floor={rec['step_over_floor']:.1f}" if rec.get("step_over_floor") else "")
            + (f" arms={rec['steps_per_arm']}" if rec.get("steps_per_arm") else "")
            + (f" stalls=[{stalls}]" if (stalls := stall_text(rec)) else ""))
