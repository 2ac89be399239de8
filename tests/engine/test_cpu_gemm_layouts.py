"""The CPU inference GEMM layouts (``engine.model.layers.Linear``, ``DeepseekV3ForCausalLM.logits``)
compute what ``F.linear`` computes, for every row count, with and without bias, and leave
training (autograd) on ``F.linear``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import Linear
from engine.model.loader import load_model


@pytest.mark.parametrize("rows", [1, 2, 8, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, 80) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    # Shapes other than [N, H] (training, references) go through F.linear as they are.
    x3 = torch.randn(2, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias))


def test_linear_keeps_autograd() -> None:
    layer = Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(8, 1) * x.detach().sum(0, keepdim=True))


def test_logits_layouts_match_the_head(dense_model_dir: Path) -> None:
    model = load_model(dense_model_dir, "float32", "cpu")
    hidden = torch.randn(3, 8, model.config.hidden_size)
    with torch.inference_mode():
        for h in (hidden[0, :1], hidden[0, :2], hidden[0], hidden):  # 1, 2, 8 rows and [3, 8, H]
            got = model.logits(h)
            assert got.shape == (*h.shape[:-1], model.config.vocab_size) and got.dtype == torch.float32
            torch.testing.assert_close(got, F.linear(h, model.lm_head.weight).float())
