"""A key-split specialisation of the tree attention kernel that Triton fails to compile runs
unsplit instead, once warned, and later calls go straight to the unsplit launch (so a CUDA
graph captured after the warm-up records a launch that compiles). The launches are stubbed:
this checks the choice, not the kernel (the interpreter and GPU tests check the kernel)."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_kernels import build_attention_inputs
from engine.kernels import tree_mla_attention as attention


def test_a_split_that_fails_to_compile_runs_unsplit(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[int] = []

    def launch(*args: object) -> None:
        splits = args[14]
        assert isinstance(splits, int)
        launched.append(splits)
        if splits > 1:
            raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(attention, "_launch_fwd", launch)
    monkeypatch.setattr(attention, "_COMPILED", set())
    monkeypatch.setattr(attention, "_UNCOMPILABLE", set())
    inputs = build_attention_inputs(2, 5, 40, 4, seed=3, dtype=torch.float32, device="cpu")
    with pytest.warns(UserWarning, match="running unsplit"):
        attention.tree_mla_attention(**inputs, num_splits=4)
    attention.tree_mla_attention(**inputs, num_splits=4)
    assert launched == [4, 1, 1]


def test_a_failure_after_a_successful_launch_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = iter([None, RuntimeError("an illegal memory access")])

    def launch(*args: object) -> None:
        error = next(calls)
        if error is not None:
            raise error

    monkeypatch.setattr(attention, "_launch_fwd", launch)
    monkeypatch.setattr(attention, "_COMPILED", set())
    monkeypatch.setattr(attention, "_UNCOMPILABLE", set())
    inputs = build_attention_inputs(2, 5, 40, 4, seed=3, dtype=torch.float32, device="cpu")
    attention.tree_mla_attention(**inputs, num_splits=4)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        attention.tree_mla_attention(**inputs, num_splits=4)
