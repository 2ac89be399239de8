"""Benchmark prompts: held-out local sources, or a fixed synthetic set for models without data.

Held-out prompts (``train.heldout``) are Python files on this machine whose content hash is not
in the model's training manifest. A model folder without a manifest (random test checkpoints)
gets synthetic prompts: a seeded random token walk with repeated phrases, so that drafting has
something to predict. Every prompt has exactly ``prompt_tokens`` tokens, so a batch needs no
padding (which keeps transformers' batched ``generate()`` comparable token for token).
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_IDS = 3  # ids 0..2 are bos/eos/pad in the recipe's tokenizer; keep prompts clear of them


def synthetic_prompts(vocab_size: int, count: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low = min(SPECIAL_IDS, vocab_size - 1)
    prompts = []
    for _ in range(count):
        phrase = torch.randint(low, vocab_size, (8,), generator=gen).tolist()
        ids: list[int] = []
        while len(ids) < prompt_tokens:
            ids += phrase if torch.rand(1, generator=gen).item() < 0.5 else torch.randint(
                low, vocab_size, (4,), generator=gen).tolist()
        prompts.append(ids[:prompt_tokens])
    return prompts


def load_prompts(
    model_dir: str | Path, tokenizer: object | None, vocab_size: int, count: int, prompt_tokens: int,
    skip: int = 0,
) -> tuple[list[list[int]], str]:
    """``count`` prompts after the first ``skip`` and where they came from (``"heldout"`` or
    ``"synthetic"``)."""
    folder = Path(model_dir)
    if tokenizer is not None and (folder / "corpus_manifest.json").is_file():
        from train.heldout import heldout_prompts

        found = heldout_prompts(folder, tokenizer, skip + count, prompt_tokens=prompt_tokens)  # type: ignore[arg-type]
        return found[skip:], "heldout"
    return synthetic_prompts(vocab_size, skip + count, prompt_tokens)[skip:], "synthetic"


def batch_of(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """The first ``batch_size`` prompts, cycling when there are fewer."""
    return [prompts[i % len(prompts)] for i in range(batch_size)]
