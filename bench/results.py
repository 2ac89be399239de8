"""Where results go and how they are written: ``bench/results/<device>-<date>.json``.

One JSON per run; ``bench serve`` adds its ``serve`` section to an existing file (the same
device and day) or writes its own. The markdown table and PNG plots are always regenerated
from the JSON (``bench.report``), never edited by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.meta import REPO, today

RESULTS_DIR = REPO / "bench" / "results"


def default_json_path(device_tag: str, out_dir: Path | None = None) -> Path:
    return (out_dir or RESULTS_DIR) / f"{device_tag}-{today()}.json"


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_plain) + "\n")
    return path


def read_json(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def merge_section(path: Path, key: str, section: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Put ``section`` under ``key`` of the JSON at ``path`` (creating it with ``meta``)."""
    doc = read_json(path) if path.is_file() else {**meta, "runs": []}
    doc[key] = section
    write_json(doc, path)
    return doc


def _plain(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
