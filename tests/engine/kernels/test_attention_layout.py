"""The Triton attention's row layout choice (``engine.kernels.tree_mla_attention._pack_heads``).

Packed rows (token x head) cut the programs of a large grid; a small grid, whose time is one
program's latency, keeps each token's heads padded to a power of two (fewer registers). The
layouts' results are checked against the reference under the interpreter
(``interpret_checks``: ``heads12_*``) and on the GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

CPU = torch.device("cpu")  # the choice counts 4 SMs off a GPU


def test_small_grids_pad_heads_large_grids_pack_them() -> None:
    from engine.kernels.tree_mla_attention import _pack_heads

    assert not _pack_heads(12, 1, 1, 64, CPU)  # one decode row: one 16-row program
    assert _pack_heads(12, 33, 4, 64, CPU)  # 4 trees of 33 nodes: 7 packed tiles each
    assert not _pack_heads(12, 5, 1, 64, CPU)  # one chain: a single packed tile


def test_a_power_of_two_head_count_is_one_layout() -> None:
    from engine.kernels.tree_mla_attention import _pack_heads

    assert _pack_heads(16, 1, 1, 64, CPU) and _pack_heads(128, 33, 1, 16, CPU)
