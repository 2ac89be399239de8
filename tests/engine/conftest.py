"""Fixtures shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model_factory import build_checkpoint


@pytest.fixture(scope="session")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A 6-token vocabulary makes random MTP drafts right often enough to exercise acceptance.
    return build_checkpoint(tmp_path_factory.mktemp("v6"), seed=0, vocab_size=6,
                            num_nextn_predict_layers=3)


@pytest.fixture(scope="session")
def small_vocab_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("v6moe"), seed=5, vocab_size=6,
                            n_routed_experts=4, first_k_dense_replace=1, q_lora_rank=16)


@pytest.fixture(scope="session")
def small_vocab_lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Dense, with a query LoRA: the layout the drafting layer (engine/model/draft_layer.py) takes.
    return build_checkpoint(tmp_path_factory.mktemp("v6lora"), seed=2, vocab_size=6,
                            num_nextn_predict_layers=3, q_lora_rank=16)
