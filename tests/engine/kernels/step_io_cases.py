"""The graphed tree step's fused bookkeeping kernels (``engine.kernels.tree_step_io``) against
the step's own torch path (``GraphedTreeStep._slots``, ``_advance_torch``, ``index_fill_``).

Shared by the interpreter checks (CPU) and the GPU tests. Each check returns ``(bad, 0.0)``:
the number of cases whose outputs differ (integers and copies: equality is exact).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

from engine.spec.graphed_tree import GraphedTreeStep


def check_step_start(device: str) -> tuple[float, float]:
    """Window slots through random block tables (positions below 0 clamped), last catch-up
    rows and root tokens, against ``GraphedTreeStep._step_start_torch``."""
    from engine.kernels.tree_step_io import step_start_triton

    gen = torch.Generator().manual_seed(41)
    bad = 0
    for B, M, bs, W, start, C in [(1, 8, 16, 47, -12, 9), (5, 10, 4, 20, -9, 4), (3, 40, 16, 130, -20, 1)]:
        buf = SimpleNamespace(
            tables=torch.randperm(1000, generator=gen)[: B * M].view(B, M).to(torch.int32),
            L=torch.randint(0, M * bs - W + start, (B,), generator=gen),
            c=torch.randint(1, C + 1, (B,), generator=gen),
            tail=torch.randint(0, 8192, (B, C), generator=gen),
        )
        buf.L[0] = 0  # the whole window's start below position 0
        offsets = torch.arange(W) + start
        step = SimpleNamespace(block_size=bs, window_offsets=offsets)
        step._slots = partial(GraphedTreeStep._slots, step)  # type: ignore[arg-type]
        want = GraphedTreeStep._step_start_torch(step, buf)  # type: ignore[arg-type]
        got = step_start_triton(buf.tables.to(device), buf.L.to(device), buf.c.to(device), buf.tail.to(device),
                                offsets.to(device), bs)  # fmt: skip
        bad += int(not all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)))
    return float(bad), 0.0


def check_verify_inputs(device: str) -> tuple[float, float]:
    """The verify forward's positions, context lengths and tree slots (greedy trees' depths per
    sequence, and a sampled shape's one row for all) against ``_verify_inputs_torch``."""
    from engine.kernels.tree_step_io import verify_inputs_triton

    gen = torch.Generator().manual_seed(59)
    bad = 0
    for B, N, W, start, shared in [(1, 32, 48, 12, False), (6, 9, 20, 5, True), (4, 4, 9, 2, False)]:
        depth = torch.randint(0, 7, (1 if shared else B, N + 1), generator=gen).expand(B, N + 1)
        L = torch.randint(10, 5000, (B,), generator=gen)
        window = torch.randint(0, 100_000, (B, W), generator=gen)
        want_buf = SimpleNamespace(L=L, tree_slots=torch.zeros(B, N + 1, dtype=torch.long))
        step = SimpleNamespace(tree_window_start=start)
        want = GraphedTreeStep._verify_inputs_torch(step, want_buf, depth, window)  # type: ignore[arg-type]
        slots = torch.zeros(B, N + 1, dtype=torch.long, device=device)
        got = verify_inputs_triton(L.to(device), depth.to(device), window.to(device), start, slots)
        same = all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
        bad += int(not (same and torch.equal(slots.cpu(), want_buf.tree_slots)))
    return float(bad), 0.0


def check_zero_cache_rows(device: str) -> tuple[float, float]:
    """Zeroing (layer, slot) rows, repeats included, against ``index_fill_`` on the flat cache."""
    from engine.kernels.tree_step_io import zero_cache_rows_triton

    gen = torch.Generator().manual_seed(43)
    bad = 0
    for layers, blocks, bs, D, n, dtype in [(3, 5, 4, 20, 7, torch.float32), (16, 9, 16, 288, 200, torch.bfloat16),
                                            (2, 3, 8, 576, 1, torch.float32)]:  # fmt: skip
        kv = torch.randn(layers, blocks, bs, D, generator=gen).to(dtype)
        layer = torch.randint(0, layers, (n,), generator=gen)
        slot = torch.randint(0, blocks * bs, (n,), generator=gen)
        want = kv.clone()
        want.view(-1, D).index_fill_(0, layer * blocks * bs + slot, 0)
        got = kv.to(device)
        zero_cache_rows_triton(got, layer.to(device), slot.to(device))
        bad += int(not torch.equal(got.cpu(), want))
    return float(bad), 0.0


def check_advance(device: str) -> tuple[float, float]:
    """The next step's inputs from random outputs (live and padding rows, every accepted
    count from 0 to the depth) against ``GraphedTreeStep._advance_torch``."""
    from engine.kernels.tree_step_io import advance_triton

    gen = torch.Generator().manual_seed(47)
    bad = 0
    for B, D, k, H, slack in [(1, 6, 4, 768, 2), (7, 3, 1, 16, 1), (9, 2, 3, 40, 3)]:
        P, C = D + 1, D + 1 + slack
        packed = torch.randint(0, 8192, (B, 2 + 3 * P), generator=gen)
        packed[:, 0] = torch.randint(0, D + 1, (B,), generator=gen)
        buf = SimpleNamespace(
            packed=packed,
            live=torch.rand(B, generator=gen) < 0.7,
            tail=torch.randint(0, 8192, (B, C), generator=gen),
            L=torch.randint(10, 500, (B,), generator=gen),
            c=torch.randint(1, C + 1, (B,), generator=gen),
            rows0=torch.randn(B, C, H, generator=gen),
            next_rows=torch.randn(B, P, H, generator=gen),
            carry=torch.randn(B, k - 1, H, generator=gen),
            next_carry=torch.randn(B, k - 1, H, generator=gen),
        )
        got = SimpleNamespace(**{name: t.clone().to(device) for name, t in vars(buf).items()})
        GraphedTreeStep._advance_torch(SimpleNamespace(C=C, D=D, device=torch.device("cpu")), buf)  # type: ignore[arg-type]
        advance_triton(got.packed, got.live, got.tail, got.L, got.c, got.next_rows, got.rows0,
                       got.next_carry, got.carry, D)  # fmt: skip
        bad += int(not all(torch.equal(getattr(got, name).cpu(), t) for name, t in vars(buf).items()))
    return float(bad), 0.0


def check_write_outputs(device: str) -> tuple[float, float]:
    """The step's packed results, module 1's next rows and the rollback's path from random
    accepted paths (greedy dtypes, and the sampled policy's bool/int64 mix) against
    ``GraphedTreeStep._write_outputs_torch``."""
    from engine.kernels.tree_step_io import write_outputs_triton
    from engine.spec.device_tree import AcceptedPath

    gen = torch.Generator().manual_seed(53)
    bad = 0
    for B, D, N, H in [(1, 6, 32, 768), (6, 3, 9, 40), (3, 2, 4, 1030)]:
        P = D + 1
        a = torch.randint(0, D + 1, (B, 1), generator=gen)
        acc = AcceptedPath(
            num_accepted=a,
            path=torch.randint(0, N + 1, (B, P), generator=gen),
            on_path=torch.arange(P)[None] <= a,
            bonus=torch.randint(0, 8192, (B, 1), generator=gen),
            has_child=torch.rand(B, P, generator=gen) < 0.5,
            sibling_rank=torch.randint(0, 4, (B, P), generator=gen),
        )
        tokens = torch.randint(0, 8192, (B, N + 1), generator=gen)
        hidden = torch.randn(B, N + 1, H, generator=gen)
        want = SimpleNamespace(packed=torch.zeros(B, 2 + 3 * P, dtype=torch.long), next_rows=torch.zeros(B, P, H),
                               path=torch.zeros(B, P, dtype=torch.long), keep=torch.zeros(B, P, dtype=torch.bool))  # fmt: skip
        got = SimpleNamespace(**{name: t.clone().to(device) for name, t in vars(want).items()})
        GraphedTreeStep._write_outputs_torch(SimpleNamespace(), want, acc, tokens, hidden)  # type: ignore[arg-type]
        on = [t.to(device) for t in (a, acc.bonus, acc.path, acc.has_child, acc.sibling_rank, acc.on_path,
                                     tokens, hidden)]  # fmt: skip
        write_outputs_triton(*on, got.packed, got.next_rows, got.path, got.keep)
        bad += int(not all(torch.equal(getattr(got, name).cpu(), t) for name, t in vars(want).items()))
    return float(bad), 0.0


def check_engine_greedy(device: str) -> tuple[float, float]:
    """The graphed tree step with the fused bookkeeping and MTP-input kernels in it (on CPU run
    by the Triton interpreter, where the step's other kernels keep their torch path) against the
    same step without them (``GraphedTreeStep.FUSED_IO``): on the demo model, greedy, float32,
    over batches of 3 (padded to the bucket of 4) and 1. Returns 1.0 when a token differs from
    autoregressive decoding, 2.0 when the two steps' acceptance counts differ (drafts are
    verified, so a wrong draft changes only those), 3.0 when the graphed step did not carry the
    decode, 4.0 when padding rows left entries in the scratch blocks; else 0.0."""
    from pathlib import Path

    from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from engine.spec.graphed_tree import GraphedTreeStep
    from train.heldout import heldout_prompts

    folder = str(Path(__file__).resolve().parents[3] / "models" / "demo")
    config = EngineConfig(cuda_graphs=True, max_batch_size=4)
    tree = SpecConfig(method="tree", min_path_prob=0.0)
    ar = LLMEngine.from_pretrained(folder, device=device, spec=SpecConfig(method="none"), engine_config=config)
    GraphedTreeStep.FUSED_IO = False
    try:
        unfused = LLMEngine.from_pretrained(folder, device=device, spec=tree, engine_config=config)
        GraphedTreeStep.FUSED_IO = True  # on CPU: the interpreter runs them
        fused = LLMEngine.from_pretrained(folder, device=device, spec=tree, engine_config=config)
    finally:
        GraphedTreeStep.FUSED_IO = None
    runner = fused.graphed_tree
    assert runner is not None and runner.fused_io
    steps: list[int] = []
    run = runner.run
    runner.run = lambda seqs, *a: steps.append(len(seqs)) or run(seqs, *a)  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = heldout_prompts(folder, fused.tokenizer, 4, 32)  # type: ignore[arg-type]
    for batch in (prompts[:3], prompts[3:]):
        want = [o.token_ids for o in ar.generate(batch, greedy)]
        for eng in (unfused, fused):
            if [o.token_ids for o in eng.generate(batch, greedy)] != want:
                return 1.0, 0.0
    if fused.acceptance.snapshot() != unfused.acceptance.snapshot():
        return 2.0, 0.0
    if len(steps) < 6:
        return 3.0, 0.0
    if torch.count_nonzero(fused.pool.kv_cache[:, fused.static_scratch_blocks]) != 0:
        return 4.0, 0.0
    return 0.0, 0.0


def check_mtp_input_parts(device: str) -> tuple[float, float]:
    """MTP input rows read from their parts (a repeated row, strided views, one to three parts)
    against the fused kernel's reference on the concatenated rows: norms and concatenation as
    ``MTPLayer.fuse_inputs`` computes them (float32)."""
    from engine.kernels.fused_layers import mtp_input_parts

    gen = torch.Generator().manual_seed(61)
    B, H, V, C, K = 3, 80, 50, 5, 4
    embed = torch.randn(V, H, generator=gen) * 2
    enorm_w, hnorm_w = torch.rand(H, generator=gen) + 0.5, torch.rand(H, generator=gen) + 0.5
    tail = torch.randint(0, V, (B, C), generator=gen)
    front_tok = torch.randint(0, V, (B, K), generator=gen)
    carry = torch.randn(B, 3, H, generator=gen)  # [B, k - 1, H]: one column used
    out_prev = torch.randn(B, C + K, H, generator=gen)  # the previous depth's outputs
    root_row = torch.randn(B, 1, H, generator=gen)
    front = torch.randn(B, K, H, generator=gen)
    cases = [  # (token parts, hidden parts): catch-up only, depth 2 (root row repeated), deeper, frontier only
        ([tail], [torch.randn(B, C, H, generator=gen)]),
        ([tail, front_tok], [carry[:, 0:1], out_prev[:, : C - 1], root_row.expand(B, K, H)]),
        ([tail, front_tok], [carry[:, 2:3], out_prev[:, : C - 1], front]),
        ([front_tok], [front]),
    ]

    def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    err = 0.0
    for toks, prevs in cases:
        ids = torch.cat(toks, 1).reshape(-1)
        prev = torch.cat(prevs, 1).reshape(ids.numel(), H)
        want = torch.cat([norm(embed[ids], enorm_w, 1e-6), norm(prev, hnorm_w, 1e-5)], -1)
        got = mtp_input_parts([t.to(device) for t in toks], [p.to(device) for p in prevs], embed.to(device),
                              enorm_w.to(device), 1e-6, hnorm_w.to(device), 1e-5)  # fmt: skip
        err = max(err, (got.cpu().double() - want.double()).abs().max().item())
    return err, 1e-5
