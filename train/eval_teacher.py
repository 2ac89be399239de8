"""Teacher-forced figures on held-out files: perplexity and per-depth MTP agreement.

The held-out files are local sources whose hash is not among the model's training files
(``train.heldout``). Each file contributes at most ``ceil(max_tokens / num_files)`` tokens, so
the figures spread over many packages rather than one long file; files are packed as
``BOS ids [EOS]`` (EOS only when the whole file fits) into windows of ``seq_len`` tokens, as in
training (``train.data``).

Per-depth figures reuse the training recipe's held-out metrics (``train.objectives``), so the
index shifts are the ones the MTP modules were trained with: depth ``d`` at row ``t`` consumes
``x[t+d]`` and predicts ``x[t+d+1]``, compared with the main model's prediction of that same
token at row ``t+d``, both given the true prefix.
  - ``greedy_agreement[d-1]``: argmax of depth ``d`` == argmax of the main model.
  - ``sampled_acceptance[d-1]``: ``E[sum_v min(p, q)]``, the chance that speculative sampling at
    temperature 1 accepts a token that depth ``d`` drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model.loader import load_model, parse_dtype
from train.data import eval_windows, iter_batches
from train.objectives import heldout_metrics


@dataclass(frozen=True)
class HeldoutTokens:
    """Tokens of held-out files: whole files (for reference windows) and the packed stream."""

    files: list[str]
    per_file: list[list[int]]  # every token of each file, no BOS/EOS
    stream: np.ndarray  # [N] packed BOS ids [EOS], at most max_tokens per file share


def tokenize_heldout(tokenizer: Any, files: list[Path], max_tokens: int) -> HeldoutTokens:
    if not files:
        raise ValueError("no held-out files found")
    texts = [f.read_text(encoding="utf-8") for f in files]
    per_file = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    cap = math.ceil(max_tokens / len(files))
    parts: list[int] = []
    for ids in per_file:
        parts.append(tokenizer.bos_token_id)
        parts.extend(ids[: cap - 1])
        if len(ids) <= cap - 1:
            parts.append(tokenizer.eos_token_id)
    return HeldoutTokens([str(f) for f in files], per_file, np.asarray(parts, dtype=np.int64))


def reference_windows(per_file: list[list[int]], length: int) -> list[list[int]]:
    """Non-overlapping windows of ``length`` tokens of real held-out code (the loop baseline)."""
    return [
        ids[i : i + length] for ids in per_file for i in range(0, len(ids) - length + 1, length)
    ]


@torch.no_grad()
def teacher_forced_metrics(
    model_dir: str | Path,
    stream: np.ndarray,
    seq_len: int,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 2,
) -> dict[str, Any]:
    """Perplexity of the main model and per-depth MTP figures on ``stream``."""
    model = load_model(model_dir, dtype=parse_dtype(dtype), device=torch.device(device))
    model.eval()
    depths = model.config.num_mtp_modules
    seq_len = min(seq_len, model.config.max_position_embeddings)
    windows = eval_windows(stream, seq_len, max_windows=max(1, len(stream) // seq_len))  # [n, T]
    batches = [b.to(device) for b in iter_batches(windows, batch_size)]
    metrics = heldout_metrics(model, batches, depths)
    return {
        "tokens": int(windows.numel()),
        "seq_len": int(windows.shape[1]),
        "loss": metrics.main_loss,
        "perplexity": math.exp(metrics.main_loss),
        "mtp_loss": metrics.mtp_loss,
        "mtp_kl": metrics.mtp_kl,
        "greedy_agreement": metrics.accept_greedy,
        "sampled_acceptance": metrics.accept_sampled,
    }
