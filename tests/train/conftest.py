"""Fixtures: a small corpus of Python files in a temporary folder, and one CPU thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_TEMPLATE = '''"""Module {i}: helpers for {topic}."""

import math


class {cls}:
    """A small {topic} helper."""

    def __init__(self, value: int = {i}) -> None:
        self.value = value
        self.marker = "{marker}"

    def scaled(self, factor: float) -> float:
        return math.sqrt(self.value) * factor + {i}


def compute_{topic}(items: list[int]) -> int:
    total = 0
    for item in items:
        if item % {mod} == 0:
            total += item * {i}
        else:
            total -= 1
    return total
'''
TOPICS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


def marker(i: int) -> str:
    """A string that occurs in file ``i`` only (to trace files into token streams)."""
    return f"UNIQUE{i:04d}ZQX"


def write_corpus(root: Path, num_files: int = 60) -> Path:
    pkg = root / "pkg"
    for i in range(num_files):
        sub = pkg / f"sub{i % 5}"
        sub.mkdir(parents=True, exist_ok=True)
        topic = TOPICS[i % len(TOPICS)]
        text = _TEMPLATE.format(
            i=i, topic=topic, cls=f"{topic.title()}Helper{i}", marker=marker(i), mod=2 + i % 7
        )
        (sub / f"mod_{i:03d}.py").write_text(text * (1 + i % 3))
    return pkg


@pytest.fixture
def corpus_root(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "src")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models train faster and the runs stay deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
