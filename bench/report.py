"""Markdown report of a results JSON: settings, correctness, the offline table, serving, cost.

``mtpserve bench report FILE.json`` rewrites ``FILE.md`` and the PNG plots next to it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.plots import write_plots
from bench.results import read_json
from bench.stats import median_interval


def _f(x: Any, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def _spread(rec: dict[str, Any], key: str, spec: str) -> str:
    lo, hi = rec.get(f"{key}_min"), rec.get(f"{key}_max")
    if rec.get(key) is None or lo is None:
        return _f(rec.get(key), spec)
    return f"{_f(rec[key], spec)} ({_f(lo, spec)}–{_f(hi, spec)})"


def offline_table(runs: list[dict[str, Any]], with_cost: bool, with_floor: bool) -> list[str]:
    head = ["T", "batch", "mode", "tokens/s (min–max)", "TPOT ms", "accepted len",
            "speedup vs ar (min–max)", "rollback ms/step", "greedy = ar"]
    if with_floor:
        head.append("step / floor")
    if with_cost:
        head += ["$ / M tokens", "saving vs ar"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted((r for r in runs if not r["skipped"]),
                    key=lambda r: (r["temperature"], r["batch_size"])):
        match = {True: "yes", False: "**NO**", None: "–"}[r["greedy_match"]]
        row = [_f(r["temperature"], "g"), str(r["batch_size"]), r["label"],
               _spread(r, "tokens_per_s", ".1f"), _f(r["tpot_ms"]), _f(r["mean_accepted_length"], ".2f"),
               _spread(r, "speedup_vs_ar", ".2f"), _f(r["rollback_ms_per_step"], ".3f"), match]
        if with_floor:
            row.append(_f(r["step_over_floor"], ".1f"))
        if with_cost:
            saving = r["saving_vs_ar"]
            row += [_f(r["cost_per_million_tokens"], ".3f"), "–" if saving is None else f"{saving:+.0%}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def speedup_grid(runs: list[dict[str, Any]]) -> list[str]:
    """Each mode's speedup over ar per temperature and batch size: the median of the paired
    rounds and a 95% interval for it (order statistics: ``bench.stats.median_interval``; ``–``
    with fewer than 6 rounds). **Bold**: the whole interval is below 1.0, a slowdown the rounds'
    spread does not explain; an interval that holds 1.0 does not tell the two apart."""
    done = [r for r in runs if r["mode"] != "ar" and r.get("round_speedups")]
    if not done:
        return []
    batches = sorted({r["batch_size"] for r in done})
    head = ["mode", "T", *[str(b) for b in batches]]
    lines = ["Speedup over ar, median of the paired rounds [95% interval of that median]; "
             "**bold**: the interval lies below 1.0:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_point = {(r["label"], r["temperature"], r["batch_size"]): r for r in done}
    for label, temperature in sorted({(r["label"], r["temperature"]) for r in done}, key=lambda k: (k[1], k[0])):
        cells = []
        for b in batches:
            rec = by_point.get((label, temperature, b))
            if rec is None:
                cells.append("–")
                continue
            interval = median_interval(rec["round_speedups"])
            text = _f(rec["speedup_vs_ar"], ".2f")
            if interval is not None:
                text += f" [{interval[0]:.2f}–{interval[1]:.2f}]"
            below = interval is not None and round(interval[1], 2) < 1.0  # below 1.00 as shown
            cells.append(f"**{text}**" if below else text)
        lines.append("| " + " | ".join([label, _f(temperature, "g"), *cells]) + " |")
    return lines


def acceptance_table(runs: list[dict[str, Any]]) -> list[str]:
    spec = [r for r in runs if r["acceptance_per_position"] and r["mode"] != "ar"]
    if not spec:
        return []
    depth = max(len(r["acceptance_per_position"]) for r in spec)
    bs = min(r["batch_size"] for r in spec)
    head = ["T", "mode", *[f"d{d + 1}" for d in range(depth)]]
    lines = [f"Acceptance per draft position (batch {bs}; share of verify steps whose accepted "
             "path reached depth d):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted((r for r in spec if r["batch_size"] == bs), key=lambda r: (r["temperature"], r["label"])):
        cells = [_f(a, ".2f") for a in r["acceptance_per_position"]]
        cells += ["–"] * (depth - len(cells))
        lines.append("| " + " | ".join([_f(r["temperature"], "g"), r["label"], *cells]) + " |")
    return lines


def adaptive_table(runs: list[dict[str, Any]]) -> list[str]:
    """What adaptive speculation chose: its decode steps per budget, at each point, the steady
    step costs it chose by and the filling steps it measured (engine steps that prefilled and
    decoded, per decode batch bucket: what a filling step's choice is made by)."""
    rows = [r for r in runs if r.get("steps_per_arm")]
    if not rows:
        return []
    lines = ["Adaptive speculation: decode steps per chosen budget (all timed repeats), the "
             "step costs it measured in that batch's bucket (ms per step, and the tokens per "
             "sequence it counted on: a drafting arm's yield pooled over batch sizes), its "
             "filling steps (ms per engine step that prefilled and decoded, at the decode "
             "batch given; steps measured in brackets), and the last round's fill questions "
             "(does the batch being filled draft once full: the answer, and the ms saved over "
             "the horizon against the catch-up and the drain, times the margin), against the "
             "ms a round actually saved (the median over rounds of ar's round time less "
             "adaptive's in the same round):", "",
             "| T | batch | steps per budget | measured arm costs | filling steps | fill questions | saved ms |",
             "|---|---|---|---|---|---|---|"]
    baseline = {(r["temperature"], r["batch_size"]): r.get("round_ms") for r in runs if r.get("mode") == "ar"}
    for r in sorted(rows, key=lambda r: (r["temperature"], r["batch_size"])):
        arms = ", ".join(f"{label} {n}" for label, n in sorted(r["steps_per_arm"].items()))
        sampled = bool(r["temperature"])
        costs = ", ".join(
            f"{c['arm']} {_f(c['step_seconds'] * 1e3, '.2f')} ms ({_f(c['tokens_per_seq'], '.2f')})"
            for c in r.get("arm_costs") or [] if bool(c.get("sampled")) == sampled
        ) or "–"
        fills = "; ".join(
            f"{_f(c['batch_size'], '.0f')}: {c['arm']} {_f(c['step_seconds'] * 1e3, '.2f')} ms ({c['steps']})"
            for c in r.get("fill_costs") or [] if bool(c.get("sampled")) == sampled
        ) or "–"
        questions = "; ".join(_fill_question(q) for q in r.get("fill_questions") or []) or "–"
        ar_ms, own_ms = baseline.get((r["temperature"], r["batch_size"])), r.get("round_ms")
        saved = (_f(statistics.median(a - b for a, b in zip(ar_ms, own_ms, strict=True)), ".1f")
                 if ar_ms and own_ms and len(ar_ms) == len(own_ms) else "–")  # fmt: skip
        lines.append(f"| {_f(r['temperature'], 'g')} | {r['batch_size']} | {arms} | {costs} | {fills} "
                     f"| {questions} | {saved} |")
    return lines


def _fill_question(q: dict[str, Any]) -> str:
    """``64: chain-4 [chain-4 38.0/(3.3+5.2)x1.00]``: the batch asked about, the answer (``none``:
    it stays autoregressive) and the terms weighed, if any."""
    answer = q.get("answer") or "none"
    if q.get("arm") is None:
        return f"{q['batch_size']}: {answer}"
    return (f"{q['batch_size']}: {answer} [{q['arm']} {_f(q['saving_ms'], '.1f')}/"
            f"({_f(q['catch_up_ms'], '.1f')}+{_f(q['drain_ms'], '.1f')})x{_f(q['margin'], '.2f')}]")


def stall_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The runs during which something that can stall a step happened (``bench.stall_probe``)."""
    from bench.stall_probe import stall_text

    rows = [(r, text) for r in runs if (text := stall_text(r))]
    if not rows:
        return []
    lines = ["Stall counters per run (garbage collections: count/pause; Triton kernel variants "
             "built or loaded: count/time; CUDA device allocations and their retries), warm-up "
             "first, then each timed round:", ""]
    for r, text in sorted(rows, key=lambda rt: (rt[0]["temperature"], rt[0]["batch_size"], rt[0]["label"])):
        lines.append(f"- T={_f(r['temperature'], 'g')} batch {r['batch_size']} {r['label']}: {text}")
    return lines


def serve_table(serve: dict[str, Any]) -> list[str]:
    st = serve["settings"]
    lines = [f"Load: {st.get('load')}, {st.get('duration_s')} s per setting, max_tokens "
             f"{st.get('max_tokens')}, temperature {st.get('temperature')}, SLO TTFT ≤ "
             f"{st.get('slo_ttft_ms')} ms and TPOT ≤ {st.get('slo_tpot_ms')} ms; prompts "
             f"{st.get('prompts')}; load average {serve.get('loadavg_start')} → {serve.get('loadavg_end')}.", "",
             "| speculation | requests | errors | req/s | output tok/s | goodput req/s | "
             "TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | accepted len |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in serve["runs"]:
        def pct(key: str, r: dict[str, Any] = r) -> str:
            p = r[key]
            return "/".join(_f(p[q], ".0f") for q in ("p50", "p90", "p99"))

        lines.append(f"| {r['spec_method']} | {r['requests']} | {r['errors']} | {_f(r['requests_per_s'], '.2f')} | "
                     f"{_f(r['output_tokens_per_s'])} | {_f(r['goodput_requests_per_s'], '.2f')} | "
                     f"{pct('ttft_ms')} | {pct('tpot_ms')} | {pct('itl_ms')} | {pct('e2e_ms')} | "
                     f"{_f(r.get('mean_accepted_length'), '.2f')} |")
    return lines


def render(doc: dict[str, Any], plots: list[Path]) -> str:
    s = doc.get("settings", {})
    runs = doc.get("runs", [])
    out = [f"# mtpserve benchmark — {doc.get('device_tag', '?')} {str(doc.get('date', ''))[:10]}", "",
           f"- model: `{doc.get('model')}`; device: {doc.get('device')}; commit `{doc.get('commit')}`",
           f"- versions: {doc.get('versions')}; load average at start {doc.get('loadavg_start')}, "
           f"end {doc.get('loadavg_end')}"]
    if runs:
        out += [f"- prompts: {doc.get('num_prompts')} × {s.get('prompt_tokens')} tokens, "
                f"**{doc.get('prompts')}**"
                + (f" (after the first {s['prompt_offset']})" if s.get("prompt_offset") else "")
                + f"; {s.get('max_new_tokens')} new tokens (EOS ignored); "
                f"dtype {s.get('dtype')}; {s.get('repeats')} timed repeats after a warm-up, "
                "median (min–max); modes alternate within each round"
                + (f"; each run after {s['spin_ms']:g} ms of GPU matrix products (boost clock)"
                   if s.get("spin_ms") else "")
                + ("; steps launched ahead of their host work (overlap on), the baseline's too"
                   if s.get("overlap_steps") else "")
                + (f"; prompts prefilled {s['prefill_chunk_tokens']} tokens per step"
                   if s.get("prefill_chunk_tokens") else "")
                + (f"; adaptive's tree arm {s['adaptive_tree']}" if s.get("adaptive_tree") else "")
                + (f"; adaptive's chain arms {s['adaptive_chains']}" if s.get("adaptive_chains") else ""),
                f"- speedup vs ar is paired per round; tokens/s counts prefill; TPOT is per sequence "
                f"after its first token; wall time {doc.get('wall_s')} s",
                ""]
        out += [f"## Correctness (greedy, before timing, {doc.get('check_dtype')})", ""]
        if doc.get("check_dtype") == "none":
            out += ["Skipped on request (--check-dtype none): this run's greedy outputs were not "
                    "checked against ar before timing.", ""]
        elif doc.get("greedy_match_strict") is False:
            out += [f"Timing ran in {s.get('dtype')}: there, verify and decode forwards round "
                    "differently, so the column 'greedy = ar' of timed runs is information; the "
                    "lossless check is this one.", ""]
        for label, res in doc.get("check", {}).items():
            from bench.check import describe

            out.append(f"- {label} vs ar: " + (res.get("error") or describe(res)))
        for label, reason in doc.get("skipped_modes", {}).items():
            out.append(f"- {label}: not run — {reason}")
        startup = doc.get("startup_s") or {}
        if startup:
            out += ["", "Engine builds (seconds per start-up stage; the weights loaded once before):", ""]
            for label, stages in startup.items():
                parts = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
                out.append(f"- {label}: {sum(stages.values()):.2f} s ({parts})")
        for label, rows in (doc.get("arm_calibration") or {}).items():
            out += ["", f"{label}: start-up calibration of each captured decode step (ms per step, "
                    "host work included; verify tokens = batch x tree nodes):", ""]
            out += calibration_table(rows)
        out += ["", "## Offline engine sweep", ""]
        if doc.get("device_rates"):
            rates = doc["device_rates"]
            out += [f"Measured device rates: copy {rates['copy_gbps']:.0f} GB/s (read + write), "
                    f"bf16 matmul {rates['matmul_tflops']:.0f} TFLOP/s.", ""]
        with_cost = any(r["cost_per_million_tokens"] is not None for r in runs)
        if with_cost:
            out += [f"Cost at ${s.get('price_per_hour')} per device-hour.", ""]
        out += offline_table(runs, with_cost, any(r["step_over_floor"] for r in runs))
        grid = speedup_grid(runs)
        if grid:
            out += [""] + grid
        out += [""] + acceptance_table(runs)
        adaptive = adaptive_table(runs)
        if adaptive:
            out += [""] + adaptive
        stalls = stall_lines(runs)
        if stalls:
            out += [""] + stalls
        skipped = sorted({(r["label"], r["skipped"]) for r in runs if r["skipped"]})
        if skipped:
            out += ["", "Points not run:", ""] + [f"- {label}: {why}" for label, why in skipped]
    if doc.get("serve"):
        out += ["", "## Serving (live server, streaming clients)", ""] + serve_table(doc["serve"])
    if plots:
        out += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(out) + "\n"


def write_report(json_path: Path) -> tuple[Path, list[Path]]:
    """Regenerate ``<stem>.md`` and the PNGs next to ``json_path``."""
    doc = read_json(json_path)
    plots = write_plots(doc, json_path.parent, json_path.stem)
    md = json_path.with_suffix(".md")
    md.write_text(render(doc, plots))
    return md, plots


def calibration_table(rows: list[dict[str, Any]]) -> list[str]:
    """Step ms per arm (columns) and batch size (rows), greedy and sampled apart."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    out = ["| T | batch | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    keys = sorted({(bool(r["sampled"]), int(r["batch_size"])) for r in rows})
    for sampled, batch in keys:
        cells = []
        for arm in arms:
            hit = [r for r in rows if r["arm"] == arm and bool(r["sampled"]) == sampled
                   and r["batch_size"] == batch]  # fmt: skip
            cells.append(f"{hit[0]['step_ms']:.2f} ({hit[0]['verify_tokens']})" if hit else "-")
        out.append(f"| {'1' if sampled else '0'} | {batch} | " + " | ".join(cells) + " |")
    return out
