"""Index alignment of the MTP objective, checked with a stub that can only be right when the
objective feeds depth d the token x[t+d] and scores it against x[t+d+1]."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from train.objectives import GREEDY_RANKS, distill_losses, heldout_metrics, joint_losses, mtp_depths
from train.presets import TINY

V = 11


class OracleModel:
    """Hidden states are one-hot tokens. The main model 'predicts' x[t+1] at t; MTP depth d
    returns one-hot x[t+d+1] after checking it was handed the right rows and tokens."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.calls: list[int] = []

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        nxt = torch.cat([x[:, 1:], x[:, :1]], dim=1)
        return F.one_hot(nxt, V).float()  # [B, T, V]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return 50.0 * h

    def mtp_forward_train(self, d: int, prev: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        n = next_ids.shape[1]
        assert n == self.x.shape[1] - 1 - d and prev.shape[1] == n
        assert torch.equal(next_ids, self.x[:, d : d + n])
        # prev must be depth d-1's output at the same positions: it predicts x[t+d]
        assert torch.equal(prev.argmax(-1), self.x[:, d : d + n])
        self.calls.append(d)
        return F.one_hot(self.x[:, d + 1 : d + 1 + n], V).float()


def test_joint_and_distill_losses_line_up_targets() -> None:
    x = torch.randint(0, V, (2, 12))
    model = OracleModel(x)
    main, mtp = joint_losses(model, x, num_depths=3)  # type: ignore[arg-type]
    assert model.calls == [1, 2, 3]
    assert float(main) < 1e-6 and all(float(loss) < 1e-6 for loss in mtp)
    kl = distill_losses(model, x, num_depths=3)  # type: ignore[arg-type]
    assert len(kl) == 3 and all(abs(float(v)) < 1e-6 for v in kl)
    metrics = heldout_metrics(model, [x], num_depths=3)  # type: ignore[arg-type]
    assert metrics.accept_greedy == [1.0, 1.0, 1.0]
    assert [row[0] for row in metrics.accept_greedy_rank] == [1.0, 1.0, 1.0]
    assert all(v == 0.0 for row in metrics.accept_greedy_rank for v in row[1:]), "rank 0 holds every hit"
    assert all(a > 0.999 for a in metrics.accept_sampled)
    assert metrics.as_dict()["chain_len_greedy"] == 4.0


def test_greedy_rank_agreement_places_the_main_argmax_in_each_modules_ranking() -> None:
    """``accept_greedy_rank[d][r]``: the share of positions where the main model's argmax is
    module d's rank-r token, checked against a direct count over the modules' logits."""
    preset = dataclasses.replace(TINY, vocab_size=64, num_mtp_modules=2)
    model = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict(preset.hf_config(0, 1, 2)))
    model.init_weights(0)
    x = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    metrics = heldout_metrics(model, [x], num_depths=2)
    assert len(metrics.accept_greedy_rank) == 2
    with torch.no_grad():
        h0 = model.forward_train(x)
        # (log-probabilities, as the metrics rank them: rounding may tie two logits there)
        main = torch.log_softmax(model.logits(h0[:, :-1]), -1).argmax(-1)  # [b, T-1]
        for (d, h), row in zip(mtp_depths(model, h0, x, 2), metrics.accept_greedy_rank, strict=True):
            order = torch.log_softmax(model.logits(h), -1).argsort(dim=-1, descending=True, stable=True)  # [b, n, V]
            rank = (order == main[:, d : d + h.shape[1], None]).float().argmax(-1)  # [b, n]
            expected = [float((rank == r).float().mean()) for r in range(GREEDY_RANKS)]
            assert row == pytest.approx(expected, abs=1e-6)
            assert row[0] == pytest.approx(metrics.accept_greedy[d - 1])
            assert sum(row) <= 1.0 + 1e-9
    assert metrics.as_dict()["accept_greedy_rank"] == metrics.accept_greedy_rank


def test_depths_stop_when_the_window_is_too_short() -> None:
    x = torch.randint(0, V, (1, 4))
    main, mtp = joint_losses(OracleModel(x), x, num_depths=5)  # type: ignore[arg-type]
    assert len(mtp) == 2  # T-1-d > 0 only for d = 1, 2


def test_distillation_moves_only_the_mtp_modules_towards_the_main_model() -> None:
    preset = dataclasses.replace(TINY, vocab_size=64, num_mtp_modules=2)
    model = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict(preset.hf_config(0, 1, 2)))
    model.init_weights(0)
    L = model.config.num_hidden_layers
    mtp_params = [
        p
        for n, p in model.named_parameters()
        if n.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}."))
    ]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in mtp_params:
        p.requires_grad_(True)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.Adam(mtp_params, lr=3e-3)
    x = torch.randint(0, 64, (4, 32))
    first = None
    for _ in range(30):
        loss = torch.stack(distill_losses(model, x, 2)).mean()
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(loss.detach()) < 0.5 * first
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
