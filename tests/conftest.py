from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model_factory import build_checkpoint

torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dense_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("dense"), seed=0)


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        tmp_path_factory.mktemp("moe"),
        seed=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        routed_scaling_factor=2.5,
    )


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The shipped demo model (trained by train/, see README)."""
    folder = Path(__file__).resolve().parents[1] / "models" / "demo"
    assert (folder / "config.json").is_file(), "models/demo is missing from the checkout"
    return folder
