"""Benchmark prompts: a pool after the first ``skip`` holds the prompts that follow them."""

from __future__ import annotations

from pathlib import Path

from bench.prompts import load_prompts


def test_skipped_prompts_are_the_pools_first(tmp_path: Path) -> None:
    whole, source = load_prompts(tmp_path, None, 512, 7, 16)  # no manifest: synthetic prompts
    later, _ = load_prompts(tmp_path, None, 512, 3, 16, skip=4)
    assert source == "synthetic" and len(whole) == 7
    assert later == whole[4:]
    assert all(p not in whole[:4] for p in later)  # the seeded walk repeats no prompt here
