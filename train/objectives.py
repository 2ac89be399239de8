"""The training objectives and held-out metrics of the MTP model.

Index convention for a window ``x[0..T)`` (DeepSeek-V3, section 2.2):
- the main model at position ``t`` predicts ``x[t+1]``, for ``t = 0 … T-2``;
- MTP depth ``d`` (1-based) at position ``t`` consumes the hidden state of depth ``d-1`` at ``t``
  and the embedding of ``x[t+d]``, and predicts ``x[t+d+1]``; valid for ``t = 0 … T-2-d``, i.e.
  ``n_d = T-1-d`` positions. Depth ``d+1`` therefore reads the first ``n_{d+1} = n_d - 1`` rows
  of depth ``d``'s output.
- the main model's own distribution for that same token ``x[t+d+1]`` (given the true prefix) is
  its output at position ``t+d``: ``main_logits[:, d : d + n_d]``. Agreement with it is what
  speculative decoding's acceptance measures, so the distillation phase matches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.model.deepseek_v3 import DeepseekV3ForCausalLM

# Ranks of each MTP module's draft whose greedy agreement the held-out metrics count (a tree's
# siblings: the engine's default tree drafts 4 per node).
GREEDY_RANKS = 8


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits [B, n, V], targets [B, n]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mtp_depths(
    model: DeepseekV3ForCausalLM, h0: torch.Tensor, x: torch.Tensor, num_depths: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(d, h_d)`` for d = 1 … num_depths; ``h_d`` [B, n_d, H] (n_d = T-1-d)."""
    seq = x.shape[1]
    h = h0  # [B, T, H]
    for d in range(1, num_depths + 1):
        n = seq - 1 - d
        if n <= 0:
            return
        h = model.mtp_forward_train(d, h[:, :n], x[:, d : d + n])  # [B, n, H]
        yield d, h


def joint_losses(
    model: DeepseekV3ForCausalLM, x: torch.Tensor, num_depths: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Main next-token loss and the per-depth MTP losses on windows ``x`` [B, T]."""
    h0 = model.forward_train(x)  # [B, T, H]
    main = _ce(model.logits(h0[:, :-1]), x[:, 1:])
    mtp = [
        _ce(model.logits(h), x[:, d + 1 : d + 1 + h.shape[1]])
        for d, h in mtp_depths(model, h0, x, num_depths)
    ]
    return main, mtp


def distill_losses(
    model: DeepseekV3ForCausalLM, x: torch.Tensor, num_depths: int, hard_weight: float = 0.0
) -> list[torch.Tensor]:
    """Per-depth KL(main ‖ MTP) towards the frozen main model's own next-token distribution,
    plus ``hard_weight`` times the true-token loss. Only the MTP modules receive gradients."""
    with torch.no_grad():
        h0 = model.forward_train(x)  # [B, T, H]
        teacher = torch.log_softmax(model.logits(h0[:, :-1]), dim=-1)  # [B, T-1, V]
    losses = []
    for d, h in mtp_depths(model, h0, x, num_depths):
        n = h.shape[1]
        log_q = torch.log_softmax(model.logits(h), dim=-1)  # [B, n, V]
        log_p = teacher[:, d : d + n]
        loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        if hard_weight:
            loss = loss + hard_weight * F.nll_loss(
                log_q.reshape(-1, log_q.shape[-1]), x[:, d + 1 : d + 1 + n].reshape(-1)
            )
        losses.append(loss)
    return losses


@dataclass
class HeldoutMetrics:
    """Held-out metrics, token-weighted. Per-depth lists are indexed by ``d - 1``.

    ``accept_sampled[d]``: E[sum_v min(p, q)], the probability that speculative sampling at
    temperature 1 accepts a token drafted by depth ``d`` from ``q`` when ``p`` is the main model's
    distribution (both given the true prefix). ``accept_greedy[d]``: argmax q == argmax p.
    ``accept_greedy_rank[d][r]``: argmax p is q's rank-``r`` token (rank 0 is ``accept_greedy``),
    for ranks ``0 .. GREEDY_RANKS - 1``: what a tree's siblings add under greedy verification.
    The chain proxies multiply them as if depths were independent: 1 + a1 + a1 a2 + …
    """

    main_loss: float
    mtp_loss: list[float]
    mtp_kl: list[float]
    accept_sampled: list[float]
    accept_greedy: list[float]
    accept_greedy_rank: list[list[float]] = field(default_factory=list)

    @staticmethod
    def chain(rates: list[float]) -> float:
        total, run = 1.0, 1.0
        for rate in rates:
            run *= rate
            total += run
        return total

    def as_dict(self) -> dict[str, Any]:
        return {
            "main_loss": self.main_loss,
            "mtp_loss": self.mtp_loss,
            "mtp_kl": self.mtp_kl,
            "accept_sampled": self.accept_sampled,
            "accept_greedy": self.accept_greedy,
            "accept_greedy_rank": self.accept_greedy_rank,
            "chain_len_sampled": self.chain(self.accept_sampled),
            "chain_len_greedy": self.chain(self.accept_greedy),
        }


@torch.no_grad()
def heldout_metrics(
    model: DeepseekV3ForCausalLM, batches: list[torch.Tensor], num_depths: int
) -> HeldoutMetrics:
    """Metrics over held-out windows (each batch [b, T] already on the model's device)."""
    sums: dict[str, list[float]] = {k: [0.0] * num_depths for k in ("ce", "kl", "acc_s")}
    rank_sums = torch.zeros(num_depths, GREEDY_RANKS, dtype=torch.float64)  # [depths, ranks]
    counts = [0] * num_depths
    main_sum, main_count = 0.0, 0
    for x in batches:
        h0 = model.forward_train(x)
        main_logits = model.logits(h0[:, :-1])  # [b, T-1, V]
        main_sum += float(_ce(main_logits, x[:, 1:])) * x[:, 1:].numel()
        main_count += x[:, 1:].numel()
        log_p_all = torch.log_softmax(main_logits, dim=-1)
        for d, h in mtp_depths(model, h0, x, num_depths):
            n = h.shape[1]
            logits = model.logits(h)
            log_q = torch.log_softmax(logits, dim=-1)  # [b, n, V]
            log_p = log_p_all[:, d : d + n]
            p, q = log_p.exp(), log_q.exp()
            tokens = x[:, d + 1 : d + 1 + n]
            i = d - 1
            sums["ce"][i] += float(_ce(logits, tokens)) * tokens.numel()
            sums["kl"][i] += float((p * (log_p - log_q)).sum(-1).sum())
            sums["acc_s"][i] += float(torch.minimum(p, q).sum(-1).sum())
            target = log_p.argmax(-1, keepdim=True)  # [b, n, 1]
            ranks = log_q.topk(min(GREEDY_RANKS, log_q.shape[-1]), dim=-1).indices  # [b, n, R]
            rank_sums[i, : ranks.shape[-1]] += (ranks == target).flatten(0, 1).sum(0).double().cpu()
            counts[i] += tokens.numel()
    per = {k: [s / max(c, 1) for s, c in zip(v, counts, strict=True)] for k, v in sums.items()}
    rank_rates = [[v / max(c, 1) for v in row] for row, c in zip(rank_sums.tolist(), counts, strict=True)]
    return HeldoutMetrics(
        main_loss=main_sum / max(main_count, 1),
        mtp_loss=per["ce"],
        mtp_kl=per["kl"],
        accept_sampled=per["acc_s"],
        accept_greedy=[row[0] for row in rank_rates],
        accept_greedy_rank=rank_rates,
    )
