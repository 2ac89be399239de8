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
        want = (ref.num_accepted, ref.path, ref.bonus, ref.has_child, ref.sibling_rank, ref.on_path)
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
        # Into columns of wider buffers, as the graphed tree writes its depth-1 candidates.
        buf_v = torch.zeros(rows, k + 5, device=device)
        buf_i = torch.zeros(rows, k + 5, dtype=torch.long, device=device)
        logprob_topk_triton(logits, k, out=(buf_v[:, 2 : k + 2], buf_i[:, 2 : k + 2]))
        if not (torch.equal(want_i, got_i) and torch.equal(buf_i[:, 2 : k + 2], got_i)):
            return 1.0, 1e-5
        if not torch.equal(buf_v[:, 2 : k + 2], got_v) or buf_i[:, :2].any() or buf_i[:, k + 2 :].any():
            return 1.0, 1e-5
        err = max(err, (want_v - got_v).abs().max().item())
    return err, 1e-5


def check_race_draw(device: str) -> tuple[float, float]:
    """Largest difference of the fused law + exponential race from ``race_draw_torch`` on the
    same noise (laws and keys, relative to the row's largest), 1.0 if a drawn token with mass
    differs or, with top-k / top-p, if the kept tokens differ; vocabularies below and at a power
    of two, 16-bit logits, laws with tokens of no mass (a cold temperature), one group of rows
    per temperature and several; top-k / top-p on and off per group, ties among the logits."""
    from engine.kernels.race_draw import race_draw_triton
    from engine.spec.device_tree import race_draw_torch

    gen = torch.Generator().manual_seed(12)
    err = 0.0
    for rows, per, vocab, k, scale, dtype, filters in [
        (6, 3, 1000, 3, 3.0, torch.float32, None), (4, 1, 8192, 1, 3.0, torch.float32, None),
        (8, 2, 8192, 4, 2.0, torch.bfloat16, None), (3, 3, 50, 0, 1.0, torch.float32, None),
        (4, 4, 64, 4, 400.0, torch.float32, None), (2, 1, 4, 4, 1.0, torch.float16, None),
        # top-k / top-p per group: off, each alone, both, k past the vocabulary, a nucleus of one
        (12, 2, 300, 3, 3.0, torch.float32, ([0, 5, 0, 40, 2**32 + 5, 0], [1.0, 1.0, 0.9, 0.5, 0.95, 1e-6])),
        (6, 1, 64, 2, 1.0, torch.float32, ([3, 0, 10, 0, 64, 7], [1.0, 0.6, 0.7, 0.99, 0.5, 0.2])),
    ] + ([  # the gpu preset's vocabulary (the interpreter takes ~15 s a row to sort it)
        (8, 2, 8192, 4, 2.0, torch.bfloat16, ([0, 50, 0, 1], [0.8, 1.0, 0.3, 1.0])),
    ] if device != "cpu" else []):  # fmt: skip
        logits = (scale * torch.randn(rows, vocab, generator=gen)).to(dtype)
        if filters is not None and vocab <= 64:
            logits = (logits * 2).round() / 2  # many ties: the order among them is the ids'
        logits = logits.to(device)
        temperature = (0.3 + torch.rand(rows // per, generator=gen)).to(device)
        top = (None, None) if filters is None else (
            torch.tensor(filters[0], device=device), torch.tensor(filters[1], device=device))  # fmt: skip
        noise = torch.empty(rows, vocab).exponential_(generator=gen).to(device) if k else None
        want_q, want_k, want_i = race_draw_torch(logits, temperature, per, noise, k, *top)
        got_q, got_k, got_i = race_draw_triton(logits, temperature, per, noise, k, *top)
        if got_q.shape != want_q.shape or got_k.shape != (rows, k) or got_i.shape != (rows, k):
            return 1.0, 1e-5
        if not torch.equal(got_i[want_k > 0], want_i[want_k > 0]) or bool((got_k[want_k == 0] != 0).any()):
            return 1.0, 1e-5
        if filters is not None and not torch.equal(got_q > 0, want_q > 0):
            return 1.0, 1e-5
        err = max(err, ((got_q - want_q).abs().amax(-1) / want_q.amax(-1)).max().item())
        if k:
            err = max(err, ((got_k - want_k).abs() / want_k[:, :1]).max().item())
    return err, 1e-5


def _random_sampled_case(gen: torch.Generator, B: int, n: int, depth: int, V: int, device: str):  # type: ignore[no-untyped-def]
    """A random tree of ``n`` nodes (at most ``depth`` deep), laws p and q close to each other,
    children drawn from their parent's q (distinct tokens), a few draws marked invalid."""
    from engine.simulator.tree_shape import TreeShape
    from engine.spec.device_tree import StaticTree

    parents, depths, ranks = [-1], [0], [0]
    for _ in range(1, n):
        choices = [i for i in range(len(parents)) if depths[i] < depth]
        parent = choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
        ranks.append(sum(1 for p in parents if p == parent))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    shape = TreeShape(parents=tuple(parents), ranks=tuple(ranks))
    internal = [i for i in range(n) if i in parents]
    tree = StaticTree.build(shape, internal, torch.device(device))
    base = 2 * torch.randn(B, n, V, generator=gen)
    p_all = torch.softmax(base, -1)
    q_all = torch.softmax(base[:, internal] + 1.5 * torch.randn(B, len(internal), V, generator=gen), -1)
    tokens = torch.zeros(B, n, dtype=torch.long)
    for i in internal:
        kids = [c for c in range(n) if parents[c] == i]
        draws = torch.multinomial(q_all[:, internal.index(i)], len(kids), generator=gen)  # [B, k]
        for j, c in enumerate(kids):
            tokens[:, c] = draws[:, j]
    valid = torch.rand(B, n, generator=gen) > 0.1
    valid[:, 0] = True
    uniforms = torch.rand(B, tree.max_depth, tree.children.shape[1], generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen).clamp_(min=1e-30)
    return tree, [t.to(device) for t in (tokens, valid, p_all, q_all, uniforms, noise)]


def check_accept_sampled(device: str) -> tuple[float, float]:
    """Share of trees where the fused sampled acceptance (count, path, bonus) differs from
    ``accept_sampled_torch`` given the same draws: random shapes and laws, vocabularies within
    one chunk and over several (a partial last chunk)."""
    from engine.kernels.sampled_accept import accept_sampled_triton
    from engine.spec.device_tree import accept_sampled_torch

    gen = torch.Generator().manual_seed(11)
    differ = total = 0
    for trial in range(15):
        n, depth, V = [(5, 2, 7), (12, 3, 50), (9, 6, 3000), (1, 1, 16), (16, 2, 40)][trial % 5]
        tree, (tokens, valid, p_all, q_all, uniforms, noise) = _random_sampled_case(gen, 16, n, depth, V, device)
        ref = accept_sampled_torch(tokens, valid, p_all, q_all, tree, uniforms, noise)
        num, path, bonus = accept_sampled_triton(tokens, valid, p_all, q_all, tree.children, tree.q_row,
                                                 uniforms, noise, block_v=1024)  # fmt: skip
        same = (ref.num_accepted[:, 0] == num) & (ref.path == path).all(1) & (ref.bonus[:, 0] == bonus)
        differ += int((~same).sum())
        total += same.numel()
    return differ / total, 0.0
