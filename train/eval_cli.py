"""``mtpserve eval --model DIR``: how well the MTP drafter serves the model, on held-out code.

    mtpserve eval --model models/demo --out models/demo/eval.json --stats-out stats.json

Held-out data are local ``.py`` files the model never trained on (``train.heldout``). Figures:
  - teacher-forced (``train.eval_teacher``): perplexity of the main model, greedy agreement and
    sampled acceptance of each MTP depth with the main model;
  - generation (``train.eval_generation``): the same prompts decoded autoregressively and with
    chain and tree speculation, greedy and at temperature 1.0: mean accepted length,
    per-position acceptance, repeated 4-gram share (``train.eval_metrics``), tokens/s and the
    speedup over autoregressive decoding with all prompts in one batch and one at a time (the
    load average is recorded: timings on a shared machine vary), and whether every greedy
    mode emitted exactly the autoregressive tokens;
  - the repeated 4-gram share of real held-out code in windows of the same length (reference).

Writes one JSON (``--out``, default ``DIR/eval.json``) and prints a short table. The JSON's
``simulator_stats`` (the tree run at temperature 1.0, with the spread of its prompts' yields,
``relative_yields``, for ``--closed-batch-tokens``) is what ``mtpserve simulate --stats``
reads; ``--stats-out`` writes it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.model.config import ModelConfig
from engine.simulator.acceptance import AcceptanceStats
from train.eval_generation import Mode, run_modes, warm_up
from train.eval_metrics import repeated_ngram_share
from train.eval_report import check_goals, format_table
from train.eval_teacher import reference_windows, teacher_forced_metrics, tokenize_heldout
from train.heldout import heldout_files, heldout_prompts
from train.tokenizer import load_tokenizer

MODES = (
    Mode("none", 0.0),
    Mode("chain", 0.0),
    Mode("tree", 0.0),
    Mode("chain", 1.0),
    Mode("tree", 1.0),
)
SIMULATOR_MODE = "tree@T1"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="mtpserve eval",
        description="Evaluate a model's MTP drafter on held-out code (see train/eval_cli.py).",
    )
    ap.add_argument("--model", default="models/demo", help="model folder (default models/demo)")
    ap.add_argument("--out", default=None, help="result JSON (default MODEL/eval.json)")
    ap.add_argument("--stats-out", default=None, help="acceptance stats JSON for `simulate`")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt")
    ap.add_argument(
        "--ppl-tokens",
        type=int,
        default=12288,
        help="held-out tokens for perplexity and agreement (default 12288)",
    )
    ap.add_argument("--ppl-files", type=int, default=32, help="held-out files they come from")
    ap.add_argument("--seq-len", type=int, default=1024, help="teacher-forced window length")
    ap.add_argument(
        "--timing-rounds",
        type=int,
        default=2,
        help="interleaved timing rounds; the fastest counts (default 2)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine, 2 threads on 2 cores gave "
        "single runs 12x slower than usual, 1 thread stays within a few percent)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    for name in (
        "prompts",
        "max_tokens",
        "prompt_tokens",
        "ppl_tokens",
        "ppl_files",
        "seq_len",
        "timing_rounds",
        "threads",
    ):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model)
    context = ModelConfig.from_folder(model).max_position_embeddings
    if args.prompt_tokens + args.max_tokens > context:
        raise ValueError(
            f"--prompt-tokens {args.prompt_tokens} plus --max-tokens {args.max_tokens} exceed "
            f"the model's context length {context}"
        )
    tokenizer = load_tokenizer(model)
    load_before = os.getloadavg()
    timings: dict[str, float] = {}

    t = time.monotonic()
    held = tokenize_heldout(tokenizer, heldout_files(model, limit=args.ppl_files), args.ppl_tokens)
    teacher = teacher_forced_metrics(model, held.stream, args.seq_len, args.device, args.dtype)
    teacher["files"] = len(held.files)
    timings["teacher_forced_s"] = time.monotonic() - t

    t = time.monotonic()
    prompts = heldout_prompts(model, tokenizer, args.prompts, args.prompt_tokens)
    warm_up(model, prompts[0], args.device, args.dtype)
    runs = run_modes(
        model, prompts, MODES, args.max_tokens, args.device, args.dtype, args.timing_rounds
    )
    timings["generation_s"] = time.monotonic() - t
    load_after = os.getloadavg()

    ar = runs["ar@T0"]
    greedy_identical = all(
        run.token_ids == ar.token_ids for run in runs.values() if run.mode.temperature == 0.0
    )
    modes = {name: run.as_dict() for name, run in runs.items()}
    ar_dict = modes["ar@T0"]
    for entry in modes.values():
        entry["speedup_vs_ar"] = entry["tokens_per_s"] / ar_dict["tokens_per_s"]
        entry["batch1_speedup_vs_ar"] = (
            entry["batch1_tokens_per_s"] / ar_dict["batch1_tokens_per_s"]
        )
    stats = runs[SIMULATOR_MODE].snapshot
    AcceptanceStats.from_dict(stats)  # fails here, not in `simulate`, if the counters are bad
    reference = reference_windows(held.per_file, args.max_tokens)
    return {
        "setup": {
            "model": str(model),
            "num_prompts": len(prompts),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "device": args.device,
            "dtype": args.dtype,
            "sampling_seed_t1": 0,
            "timing": "batched: all prompts in one generate(); batch1: one prompt per "
            "generate(), in turn; fastest of timing_rounds interleaved rounds; speedup = "
            "tokens/s over ar@T0 at the same load",
            "timing_rounds": args.timing_rounds,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": list(load_before),
            "loadavg_after": list(load_after),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "timings_s": timings,
        },
        "teacher_forced": teacher,
        "modes": modes,
        "greedy_identical_to_ar": greedy_identical,
        "reference": {
            "what": f"real held-out code, {len(reference)} windows of {args.max_tokens} tokens",
            "repeated_4gram_share": repeated_ngram_share(reference, 4),
        },
        "goals": check_goals(modes, greedy_identical),
        "simulator_stats": stats,
        "simulator_stats_mode": SIMULATOR_MODE,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = evaluate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mtpserve eval: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out) if args.out else Path(args.model) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps(result["simulator_stats"], indent=1) + "\n")
    print(format_table(result))
    print(f"\nwrote {out}" + (f" and {args.stats_out}" if args.stats_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
