"""Random draft trees for the fused greedy acceptance kernel vs ``accept_greedy``'s torch ops.

Shared by the interpreter checks (CPU) and the GPU tests. Trees come from ``select_nodes`` over
depth-major candidates (the graphed step's layout); tokens differ among siblings, and about
half of the nodes are made the target's argmax at their parent, so paths of every length occur.
"""

from __future__ import annotations

import torch


def _random_trees(gen: torch.Generator, B: int, K: int, D: int, N: int, device: str):  # type: ignore[no-untyped-def]
    from engine.spec.device_tree import select_nodes

    T = K + (D - 1) * K * K
    parents = [-1] * K
    for m in range(2, D + 1):
        first = 0 if m == 2 else K + (m - 3) * K * K  # the frontier: candidates of depth m - 1
        parents += [first + j // K for j in range(K * K)]
    scores = -torch.rand(B, T, generator=gen).cumsum(1)
    _, P = select_nodes(scores, torch.tensor(parents).expand(B, T), N)  # [B, N+1]
    n = N + 1
    depth = torch.zeros(B, n, dtype=torch.long)
    for i in range(1, n):
        depth[:, i] = depth.gather(1, P[:, i : i + 1]).squeeze(1) + 1
    tokens = torch.arange(n).expand(B, n) * 7 + torch.randint(0, 3, (B, 1), generator=gen)
    target = torch.randint(0, 7 * n + 3, (B, n), generator=gen)
    force = torch.rand(B, n, generator=gen) < 0.5
    for b in range(B):
        for i in range(1, n):
            if force[b, i]:
                target[b, P[b, i]] = tokens[b, i]
    return [t.to(device) for t in (tokens, P, depth, target)]


def check_accept_greedy(device: str) -> tuple[float, float]:
    """0 when the kernel's outputs equal the torch ops' on 30 batches of random trees."""
    from engine.kernels.tree_accept import accept_greedy_triton
    from engine.spec.device_tree import accept_greedy_torch

    gen = torch.Generator().manual_seed(5)
    for trial in range(30):
        K, D, N = [(3, 4, 12), (4, 6, 32), (1, 5, 5), (2, 3, 4)][trial % 4]
        tokens, parents, depth, target = _random_trees(gen, 6, K, D, N, device)
        ref = accept_greedy_torch(tokens, parents, depth, target, D)
        got = accept_greedy_triton(tokens, parents, target, D)
        want = (ref.num_accepted, ref.path, ref.bonus, ref.has_child, ref.sibling_rank)
        if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return 1.0, 0.0
    return 0.0, 0.0


def check_logprob_topk(device: str) -> tuple[float, float]:
    """Largest difference of the fused log-softmax + top-k from the torch ops (values), 1.0 if
    an index differs; rows of random logits, vocabularies below and at a power of two."""
    from engine.kernels.logprob_topk import logprob_topk_triton

    gen = torch.Generator().manual_seed(9)
    err = 0.0
    for rows, vocab, k, dtype in [(5, 1000, 3, torch.float32), (3, 8192, 4, torch.float32),
                                  (7, 8192, 1, torch.float16), (2, 4, 4, torch.float32)]:  # fmt: skip
        logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
        want_v, want_i = torch.log_softmax(logits, -1, dtype=torch.float32).topk(k, -1)
        got_v, got_i = logprob_topk_triton(logits, k)
        if not torch.equal(want_i, got_i):
            return 1.0, 1e-5
        err = max(err, (want_v - got_v).abs().max().item())
    return err, 1e-5
