"""What a model folder says about its text: the tokenizer and the end-of-sequence ids.

The tokenizer is transformers' own (``AutoTokenizer``, local files only); a folder without
tokenizer files serves token ids alone. The EOS ids come from ``generation_config.json`` where
it names them (an int or a list, as transformers writes it), else from ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.model.config import ModelConfig
from engine.model.loader import CheckpointError


def load_tokenizer(folder: Path) -> object | None:
    """The folder's tokenizer, or None where it has no tokenizer files."""
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # noqa: PLC0415 (heavy import, only when needed)

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def eos_token_ids(folder: Path, cfg: ModelConfig) -> frozenset[int]:
    """The ids that end a request (none if neither file names one)."""
    value: object = None
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(f"{gen} is not a JSON object of generation settings: {exc}") from exc
    if value is None:
        value = cfg.eos_token_id
    if value is None:
        return frozenset()
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset({value})
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {value!r} (in {folder})")
    return frozenset(value)
