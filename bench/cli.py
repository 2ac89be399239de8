"""``mtpserve bench offline|serve|report``: run benchmarks, write results, regenerate reports.

Examples::

    mtpserve bench offline --model models/demo --batch-sizes 1,2,4,8 --max-new-tokens 64
    mtpserve bench serve --model models/demo --concurrency 4 --duration-s 30
    mtpserve bench report bench/results/cpu-2026-11-30.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def _budgets(text: str) -> list[int | str]:
    return [int(t) if t.strip().isdigit() else t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _device_default() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="models/demo", help="model folder (default models/demo)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON file, or a folder for <device>-<date>.json (default bench/results/)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (serve: of the server it starts); on a shared machine 1 "
                        "avoids threads spinning against other processes")
    p.add_argument("--no-report", action="store_true", help="do not write the .md and PNGs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    off = sub.add_parser("offline", help="engine sweep: modes x batch sizes x temperatures")
    _add_common(off)
    off.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    off.add_argument("--check-dtype", default=None, help="dtype of the greedy check before timing (default: float32 on a GPU); 'none' skips it, for a timing run whose check already passed in an earlier run")
    off.add_argument("--batch-sizes", type=_ints, default=None,
                     help="comma list (default CPU 1,2,4,...,64; GPU 1,2,4,...,256)")
    off.add_argument("--temperatures", type=_floats, default=[0.0, 0.7])
    off.add_argument("--max-new-tokens", type=int, default=64)
    off.add_argument("--prompt-tokens", type=int, default=64)
    off.add_argument("--num-prompts", type=int, default=None, help="default: the largest batch, or --min-sequences if more")
    off.add_argument("--prompt-offset", type=int, default=0,
                     help="held-out prompts skipped first (256: none a default GPU sweep uses)")
    off.add_argument("--modes", type=_strs,
                     default=["chain", "tree", "adaptive", "transformers", "transformers-mtp"],
                     help="comma list; ar always runs")
    off.add_argument("--tree-budgets", type=_budgets, default=None,
                     help="per tree mode: draft tokens of the default shape, or TOPKxDEPTH-N "
                          "(e.g. 32,4x8-40; default CPU 4,8; GPU 8,32,64)")
    off.add_argument("--adaptive-tree", default=None,
                     help="TOPKxDEPTH-N: the adaptive mode's tree arm (default: the device's default tree)")
    off.add_argument("--adaptive-chains", type=_ints, default=None,
                     help="depths of the adaptive mode's chain arms, e.g. 4,6 (default: one, CHAIN_DEPTH)")
    off.add_argument("--repeats", type=int, default=3)
    off.add_argument("--min-sequences", type=int, default=0,
                     help="more rounds at small batches: each point decodes at least this many prompts")
    off.add_argument("--warmup-tokens", type=int, default=None,
                     help="tokens of the warm-up round (default CPU 8; GPU: --max-new-tokens)")
    off.add_argument("--overlap-steps", choices=["on", "off", "auto"], default="auto",
                     help="launch steady decode steps ahead of their host work "
                          "(EngineConfig.overlap_steps; auto: on CUDA, off on a CPU)")
    off.add_argument("--launch-after-prefill", choices=["on", "off"], default="on",
                     help="with overlap, a prefill whose prompts make up the decode batch also "
                          "launches its first decode step (EngineConfig.launch_after_prefill)")
    off.add_argument("--early-catch-up", choices=["on", "off"], default="on",
                     help="a prefill's MTP catch-up queued before its first tokens are read "
                          "(EngineConfig.early_catch_up)")
    off.add_argument("--drafting-layer", choices=["on", "off", "auto"], default="auto",
                     help="the MTP modules' fused drafting forward in the graphed tree steps "
                          "(EngineConfig.drafting_layer; auto: on CUDA in 16 bits)")
    off.add_argument("--prefill-chunk-tokens", type=int, default=None,
                     help="prompt tokens prefilled per step by every engine "
                          "(EngineConfig.prefill_chunk_tokens; default: the engine's per device)")
    off.add_argument("--spin-ms", type=float, default=0.0,
                     help="GPU: milliseconds of matrix products before every run, so each starts "
                          "at the boost clock (an idle GPU's clock is a fraction of it)")
    off.add_argument("--check-batch", type=int, default=None, help="default: the largest batch")
    off.add_argument("--check-tokens", type=int, default=None, help="default: --max-new-tokens")
    off.add_argument("--kv-memory-mb", type=int, default=None)
    off.add_argument("--time-limit-s", type=float, default=None,
                     help="skip (and say so) the points not started within this time")
    off.add_argument("--price-per-hour", type=float, default=None,
                     help="device price in $/h: adds cost per million output tokens")
    off.add_argument("--no-progress", action="store_true")

    srv = sub.add_parser("serve", help="streaming load test against a live server")
    _add_common(srv)
    srv.add_argument("--url", default=None, help="target a running server instead of starting one")
    srv.add_argument("--api-key", default=None, help="with --url (default $MTPSERVE_API_KEY)")
    srv.add_argument("--label", default="external", help="with --url: name of the setting")
    srv.add_argument("--server-logs", type=Path, default=None,
                     help="folder for the started servers' logs (default: a temp folder)")
    srv.add_argument("--spec-methods", type=_strs, default=["adaptive", "none"])
    srv.add_argument("--server-args", default="", help="extra flags for mtpserve serve (one string)")
    load = srv.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop (default 4)")
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests/s")
    srv.add_argument("--duration-s", type=float, default=30.0)
    srv.add_argument("--max-tokens", type=int, default=64)
    srv.add_argument("--prompt-tokens", type=int, default=64)
    srv.add_argument("--num-prompts", type=int, default=32)
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    srv.add_argument("--slo-tpot-ms", type=float, default=200.0)

    rep = sub.add_parser("report", help="regenerate the markdown and PNGs from a results JSON")
    rep.add_argument("json", type=Path)
    return parser


def _offline(args: argparse.Namespace, device: str) -> int:
    from bench.offline import OfflineSettings, run_offline

    gpu = device.startswith("cuda")
    top = 256 if gpu else 64
    settings = OfflineSettings(
        model=args.model, device=device, dtype=args.dtype or ("bfloat16" if gpu else "float32"),
        check_dtype=args.check_dtype or ("float32" if gpu else None),
        batch_sizes=args.batch_sizes or [2**i for i in range(top.bit_length()) if 2**i <= top],
        temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
        prompt_tokens=args.prompt_tokens, num_prompts=args.num_prompts,
        prompt_offset=args.prompt_offset, adaptive_tree=args.adaptive_tree,
        adaptive_chains=args.adaptive_chains, modes=args.modes,
        tree_budgets=args.tree_budgets if args.tree_budgets is not None else ([8, 32, 64] if gpu else [4, 8]),
        repeats=args.repeats, min_sequences=args.min_sequences,
        warmup_tokens=args.warmup_tokens if args.warmup_tokens is not None else (0 if gpu else 8), check_batch=args.check_batch,
        check_tokens=args.check_tokens, kv_memory_mb=args.kv_memory_mb,
        time_limit_s=args.time_limit_s, price_per_hour=args.price_per_hour, freeze_gc=True,
        spin_ms=args.spin_ms, overlap_steps=None if args.overlap_steps == "auto" else args.overlap_steps == "on",
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        drafting_layer=None if args.drafting_layer == "auto" else args.drafting_layer == "on",
        launch_after_prefill=args.launch_after_prefill == "on",
        early_catch_up=args.early_catch_up == "on",
    )
    doc, ok = run_offline(settings, progress=not args.no_progress)
    from bench.results import read_json, write_json

    path = _json_path(args.out, doc["device_tag"])
    if path.is_file() and "serve" in (old := read_json(path)):
        doc["serve"] = old["serve"]  # keep a serving section written earlier
    write_json(doc, path)
    print(f"wrote {path}")
    _report(path, args.no_report)
    if not ok:
        print("bench offline: a greedy check FAILED (see 'check' and 'greedy_match')", file=sys.stderr)
    return 0 if ok else 1


def _serve(args: argparse.Namespace, device: str) -> int:
    import shlex
    import tempfile

    from bench.meta import device_tag, run_metadata
    from bench.results import merge_section
    from bench.serve import ServeSettings, run_serve

    settings = ServeSettings(
        model=args.model, url=args.url, api_key=args.api_key, label=args.label,
        spec_methods=args.spec_methods, device=device, server_args=shlex.split(args.server_args),
        concurrency=args.concurrency if args.concurrency or args.rate else 4, rate=args.rate,
        duration_s=args.duration_s, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
        num_prompts=args.num_prompts, temperature=args.temperature,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, threads=args.threads,
    )
    path = _json_path(args.out, device_tag(device))
    log_dir = args.server_logs or Path(tempfile.gettempdir()) / "mtpserve-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}")
    section = run_serve(settings, log_dir=log_dir)
    merge_section(path, "serve", section, run_metadata(device, args.model))
    print(f"wrote serve section of {path}")
    _report(path, args.no_report)
    errors = sum(r["errors"] for r in section["runs"])
    return 0 if errors == 0 else 1


def _json_path(out: Path | None, tag: str) -> Path:
    """``--out``: a ``.json`` file, or a folder that gets ``<device>-<date>.json``."""
    from bench.results import default_json_path

    if out is not None and out.suffix == ".json":
        return out
    return default_json_path(tag, out)


def _report(path: Path, skip: bool) -> None:
    if skip:
        return
    from bench.report import write_report

    md, plots = write_report(path)
    print(f"wrote {md}" + "".join(f"\nwrote {p}" for p in plots))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        _report(args.json, False)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or _device_default()
    if args.command == "offline":
        return _offline(args, device)
    return _serve(args, device)


if __name__ == "__main__":
    sys.exit(main())
