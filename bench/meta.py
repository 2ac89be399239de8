"""Who, what and where of a benchmark run: date, commit, device, machine load.

The commit is read from ``.git`` files directly (no ``git`` process), so the code runs where
only a copy of the working tree exists; it is HEAD, and uncommitted edits are not visible in it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def git_commit(repo: Path = REPO) -> str:
    """HEAD's commit id, ``$MTPSERVE_COMMIT`` if set, else ``"unknown"``."""
    if os.environ.get("MTPSERVE_COMMIT"):
        return os.environ["MTPSERVE_COMMIT"]
    git = repo / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        packed = git / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        pass
    return "unknown"


def device_name(device: str) -> str:
    """Long device description: the GPU name, or the CPU model and core count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def device_tag(device: str) -> str:
    """Short tag for file names: ``cpu``, ``h200``, ``a100``..."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    match = re.search(r"\b([abhlv]\d{2,3}|rtx\s?\d{4})\b", name)
    return (match.group(1) if match else "gpu").replace(" ", "")


def today() -> str:
    return dt.date.today().isoformat()


def run_metadata(device: str, model: str) -> dict[str, Any]:
    """Top-level fields every results file carries."""
    import transformers

    meta: dict[str, Any] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device_name(device),
        "device_tag": device_tag(device),
        "model": model,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "loadavg_start": list(os.getloadavg()),
    }
    if device.startswith("cuda"):
        try:
            import triton

            meta["versions"]["triton"] = triton.__version__
        except ImportError:
            pass
    return meta
