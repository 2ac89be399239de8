"""Held-out evaluation prompts: Python sources on *this* machine the model never trained on.

A model folder made by the recipe carries ``corpus_manifest.json`` with the sha256 of every file
it trained on. Any local ``.py`` file whose content hash is not among the training files is
unseen by construction, whatever machine it sits on. Files from the manifest's own held-out
split come first when they exist here; then other unseen files of the local standard library
and site-packages, in a fixed order. Prompts start at a line boundary a third into the file, so
they are code rather than licence headers.
"""

from __future__ import annotations

import hashlib
import json
import site
import sysconfig
from pathlib import Path
from typing import Protocol


class _Tokenizer(Protocol):
    def __call__(self, text: str) -> dict[str, list[int]]: ...


def training_hashes(model_dir: str | Path) -> set[str]:
    manifest = Path(model_dir) / "corpus_manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{manifest} not found: held-out prompts need the training manifest of the model"
        )
    files = json.loads(manifest.read_text())["files"]
    return {f["sha256"] for f in files if not f.get("heldout")}


def _local_roots() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    roots += [Path(p) for p in site.getsitepackages()]
    return [r for r in roots if r.is_dir()]


def heldout_files(model_dir: str | Path, limit: int = 64, min_bytes: int = 2000) -> list[Path]:
    """Up to ``limit`` local source files whose content the model never trained on."""
    seen = training_hashes(model_dir)
    picked: list[Path] = []
    for root in _local_roots():
        for path in sorted(root.rglob("*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if len(data) < min_bytes or hashlib.sha256(data).hexdigest() in seen:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            picked.append(path)
            if len(picked) >= limit * 8:
                break
        if len(picked) >= limit * 8:
            break
    # Spread the choice over packages rather than taking one package's files.
    step = max(1, len(picked) // max(limit, 1))
    return picked[::step][:limit]


def prompt_text(path: Path, num_chars: int = 600) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.find("\n", len(text) // 3)
    start = 0 if start < 0 else start + 1
    return text[start : start + num_chars]


def heldout_prompts(
    model_dir: str | Path,
    tokenizer: _Tokenizer,
    count: int,
    prompt_tokens: int = 64,
) -> list[list[int]]:
    """``count`` token-id prompts of ``prompt_tokens`` tokens from unseen local files."""
    prompts: list[list[int]] = []
    for path in heldout_files(model_dir, limit=count * 2):
        ids = tokenizer(prompt_text(path, num_chars=prompt_tokens * 8))["input_ids"]
        if len(ids) >= prompt_tokens:
            prompts.append(list(ids[:prompt_tokens]))
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out prompts of {prompt_tokens} tokens found")
    return prompts
