"""``mtpserve train``: corpus → tokenizer → token streams → joint + distillation training → HF folder.

    python -m train --preset demo --out models/demo --time-budget-s 420

The time budget counts from the start of the command and covers corpus discovery, tokenizer
training and tokenisation; training stops when it is spent, then the best weights are exported
(a few seconds more). Intermediate files (corpus manifest, tokenizer, token arrays, checkpoint)
live in ``--work-dir`` (default ``<out>.work``); ``--resume`` reuses them and continues from the
last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from engine.model.config import ModelConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.loader import load_model
from train.corpus import Corpus, CorpusConfig, build_corpus, read_text
from train.data import WindowSampler, encode_texts, eval_windows, load_tokens, save_tokens
from train.export import export_tensors, save_weights, weight_bytes, write_configs
from train.presets import PRESETS, Preset, get_preset, parse_override
from train.tokenizer import load_tokenizer, sample_texts, save_tokenizer, train_tokenizer
from train.trainer import RunSettings, Trainer

LOG_NAME = "training_log.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mtpserve train", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--out", required=True, type=Path, help="the Hugging Face folder to write")
    ap.add_argument("--work-dir", type=Path, help="checkpoints and caches (default: <out>.work)")
    ap.add_argument(
        "--time-budget-s", type=float, help="wall seconds from start to end of training"
    )
    ap.add_argument("--joint-steps", type=int, help="steps of the joint phase (default: preset)")
    ap.add_argument("--distill-steps", type=int, help="steps of the distillation phase")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from <work-dir>/ckpt")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the joint phase (default: the preset's choice, CUDA only)",
    )
    ap.add_argument(
        "--corpus-root",
        action="append",
        metavar="[LABEL=]PATH",
        help="use these folders instead of the installed stdlib and site-packages (repeatable)",
    )
    ap.add_argument("--max-corpus-mb", type=float, help="cap on training-split bytes")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a preset field, e.g. num_mtp_modules=6 (repeatable)",
    )
    ap.add_argument("--ckpt-every-s", type=float, default=180.0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        ap.error("--time-budget-s must be positive")
    try:
        args.overrides = dict(parse_override(spec) for spec in args.set)
    except ValueError as err:
        ap.error(str(err))
    return args


def _roots(specs: list[str] | None) -> list[tuple[str, Path]] | None:
    if not specs:
        return None
    roots = []
    for i, spec in enumerate(specs):
        label, sep, path = spec.partition("=")
        roots.append((label, Path(path)) if sep else (f"root{i}", Path(spec)))
    return roots


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but CUDA is not available")
    return device


def prepare_data(
    preset: Preset, work: Path, roots: list[tuple[str, Path]] | None, reuse: bool
) -> tuple[Corpus, Any, np.ndarray, np.ndarray, dict[str, float]]:
    """Corpus, tokenizer and the two token streams; cached in ``work`` for ``--resume``."""
    timings: dict[str, float] = {}
    data_dir = work / "data"
    cached = reuse and all(
        (data_dir / n).exists()
        for n in ("corpus_manifest.json", "tokenizer", "train.npy", "heldout.npy")
    )
    if cached:
        corpus = Corpus.load(data_dir)
        tokenizer = load_tokenizer(data_dir / "tokenizer")
        return (
            corpus,
            tokenizer,
            load_tokens(data_dir / "train.npy"),
            load_tokens(data_dir / "heldout.npy"),
            timings,
        )
    t = time.monotonic()
    config = CorpusConfig(
        max_train_bytes=preset.max_train_bytes, heldout_fraction=preset.heldout_fraction
    )
    corpus = build_corpus(config, roots)
    corpus.save(data_dir)
    timings["corpus_s"] = time.monotonic() - t
    print(f"corpus: {corpus.stats} in {timings['corpus_s']:.1f}s", flush=True)

    t = time.monotonic()
    train_texts = (read_text(f) for f in corpus.train_files)
    tokenizer = train_tokenizer(
        sample_texts(train_texts, preset.tokenizer_sample_bytes), preset.vocab_size
    )
    save_tokenizer(tokenizer, data_dir / "tokenizer")
    tokenizer = load_tokenizer(data_dir / "tokenizer")
    timings["tokenizer_s"] = time.monotonic() - t
    print(f"tokenizer: vocab {len(tokenizer)} in {timings['tokenizer_s']:.1f}s", flush=True)

    t = time.monotonic()
    train = encode_texts(tokenizer, (read_text(f) for f in corpus.train_files))
    heldout = encode_texts(tokenizer, (read_text(f) for f in corpus.heldout_files))
    save_tokens(train, data_dir / "train.npy")
    save_tokens(heldout, data_dir / "heldout.npy")
    timings["tokenize_s"] = time.monotonic() - t
    print(
        f"tokens: train {len(train):,} heldout {len(heldout):,} "
        f"({corpus.stats['train_bytes'] / max(len(train), 1):.2f} bytes/token) "
        f"in {timings['tokenize_s']:.1f}s",
        flush=True,
    )
    return corpus, tokenizer, train, heldout, timings


def build_model(
    preset: Preset, tokenizer: Any, seed: int, device: torch.device
) -> DeepseekV3ForCausalLM:
    if len(tokenizer) > preset.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens, model vocab is {preset.vocab_size}"
        )
    hf = preset.hf_config(tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict(hf))
    model.init_weights(seed)
    return model.to(device)


def export(
    model: DeepseekV3ForCausalLM, preset: Preset, tokenizer: Any, corpus: Corpus, out: Path
) -> dict[str, Any]:
    """Write the HF folder; returns facts for the log. Refuses to exceed the preset's size."""
    cfg = model.config
    hf = preset.hf_config(tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    hf.update(cfg.to_hf_dict())
    tensors = export_tensors(model.state_dict(), cfg.tie_word_embeddings, preset.export_dtype)
    out.mkdir(parents=True, exist_ok=True)
    index = save_weights(tensors, out, preset.max_shard_bytes)
    write_configs(out, hf, preset.export_dtype)
    save_tokenizer(tokenizer, out)
    corpus.save(out)
    size = weight_bytes(out)
    if preset.max_weight_bytes is not None and size > preset.max_weight_bytes:
        raise ValueError(
            f"exported weights are {size} bytes, over the preset's {preset.max_weight_bytes}"
        )
    return {
        "weight_bytes": size,
        "num_tensors": len(tensors),
        "num_shards": len(set(index["weight_map"].values())),
        "num_parameters": sum(t.numel() for t in tensors.values()),
    }


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    overrides: dict[str, Any] = dict(args.overrides)
    if args.max_corpus_mb is not None:
        overrides["max_train_bytes"] = int(args.max_corpus_mb * 1e6)
    if args.batch_size is not None:
        overrides["batch_size"] = args.batch_size
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    preset = get_preset(args.preset, **overrides)
    device = _device(args.device)
    out: Path = args.out
    work: Path = args.work_dir or out.with_name(out.name + ".work")
    torch.manual_seed(args.seed)
    print(f"mtpserve train: preset={preset.name} device={device} out={out} work={work}", flush=True)

    corpus, tokenizer, train_tokens, heldout_tokens, timings = prepare_data(
        preset, work, _roots(args.corpus_root), reuse=args.resume
    )
    model = build_model(preset, tokenizer, args.seed, device)
    sampler = WindowSampler(train_tokens, preset.seq_len, preset.batch_size, args.seed, device)
    heldout = eval_windows(heldout_tokens, preset.seq_len, preset.eval_windows)
    settings = RunSettings(
        device=device,
        ckpt_dir=work / "ckpt",
        seed=args.seed,
        deadline=t0 + args.time_budget_s if args.time_budget_s else None,
        joint_steps=args.joint_steps,
        distill_steps=args.distill_steps,
        resume=args.resume,
        ckpt_every_s=args.ckpt_every_s,
        compile=(preset.compile_joint if args.compile is None else args.compile)
        and device.type == "cuda",
        progress=not args.no_progress,
    )
    trainer = Trainer(model, preset, sampler, heldout, settings)
    t_train = time.monotonic()
    state = trainer.fit()
    timings["train_s"] = time.monotonic() - t_train
    final = trainer.evaluate().as_dict()

    facts = export(model, preset, tokenizer, corpus, out)
    reloaded = load_model(
        out, dtype="float32", device="cpu"
    )  # fails loudly if the folder is broken
    facts["reloaded_parameters"] = sum(p.numel() for p in reloaded.parameters())
    timings["total_s"] = time.monotonic() - t0
    log = {
        "preset": asdict(preset),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "corpus": corpus.stats,
        "tokens": {
            "train": int(len(train_tokens)),
            "heldout": int(len(heldout_tokens)),
            "vocab": len(tokenizer),
        },
        "epochs": sampler.epochs_at(state.data_step),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "phases": state.phase_summary,
        "final_heldout": final,
        "export": facts,
        "history": state.history,
    }
    (out / LOG_NAME).write_text(json.dumps(log, indent=1) + "\n")
    print(
        f"done in {timings['total_s']:.0f}s: {out} ({facts['weight_bytes'] / 1e6:.1f} MB weights, "
        f"{facts['num_parameters'] / 1e6:.2f}M params); held-out main loss {final['main_loss']:.3f}, "
        f"accept(T=1) {[round(a, 3) for a in final['accept_sampled']]}, "
        f"greedy {[round(a, 3) for a in final['accept_greedy']]}",
        flush=True,
    )
    return 0
