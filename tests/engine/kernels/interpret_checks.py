"""Triton kernels vs their PyTorch references under ``TRITON_INTERPRET=1`` on CPU tensors.

Run as ``python -m tests.engine.kernels.interpret_checks`` it sets the variable *before* Triton
is imported (``@triton.jit`` picks interpreter or compiler at decoration time), runs every case
and prints one JSON object ``{case: {"err": float, "tol": float} | {"error": str}}``. The pytest
side (``test_triton_interpret.py``) runs it once in a subprocess so that compiled kernels in the
same test session (GPU tests) are never replaced by interpreted ones.

bfloat16 is not checked here: the interpreter's ``tl.dot`` mishandles bfloat16 operands (Triton
3.6 and 3.8); float16 takes the same low-precision path, and the GPU tests cover bfloat16.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
from collections.abc import Callable

import torch

from tests.engine.kernels.accept_cases import (
    check_accept_greedy,
    check_accept_sampled,
    check_logprob_topk,
    check_race_draw,
)
from tests.engine.kernels.commit_cases import check_tree_commit
from tests.engine.kernels.draft_cases import (
    check_draft_layer,
    check_draft_rope,
    check_scaled_silu_mul,
)
from tests.engine.kernels.fused_cases import (
    FUSED_CASES,
    check_add_rms_norm,
    check_mtp_input,
    check_rms_norm,
    check_rope_latent,
    check_silu_mul,
)
from tests.engine.kernels.step_io_cases import (
    check_advance,
    check_engine_greedy,
    check_mtp_input_parts,
    check_step_start,
    check_verify_inputs,
    check_write_outputs,
    check_zero_cache_rows,
)
from tests.engine.kernels.tree_build_cases import (
    check_grow_frontier,
    check_mtp_rows,
    check_select_tree,
)

# name -> (make_case kwargs, kernel kwargs); checked against the reference and the naive loop.
ATTENTION_CASES: dict[str, tuple[dict, dict]] = {
    "tree_fp32": (dict(seed=0, ctx_lens=[0, 5, 17, 9], new_counts=[3, 1, 6, 4]), {}),
    "tree_fp32_split3": (
        dict(seed=1, ctx_lens=[0, 5, 23, 9], new_counts=[3, 1, 6, 4]), dict(num_splits=3)
    ),
    "tree_fp32_bm32_bn16": (
        dict(seed=2, ctx_lens=[4, 11], new_counts=[8, 5], heads=2, rank=32, block_size=8),
        dict(block_m=32, block_n=16),
    ),
    "causal_prefill_fp32": (
        dict(seed=3, ctx_lens=[0, 6], new_counts=[9, 5], mask_kind="causal", heads=2, rank=32,
             block_size=16),
        {},
    ),
    "decode_fp32_split2": (
        dict(seed=4, ctx_lens=[1, 13, 40], new_counts=[1, 1, 1], heads=4), dict(num_splits=2)
    ),
    "query_ctx_fp32": (
        dict(seed=5, ctx_lens=[7, 12], new_counts=[4, 3], with_query_ctx=True), {}
    ),
    "heads20_fp32": (dict(seed=6, ctx_lens=[5, 9], new_counts=[2, 3], heads=20), {}),
    # Rows are packed token * H + head: with 12 heads a 16-row tile holds parts of two tokens
    # (its key range ends at the later one's) and a 64-row tile five and a third.
    "heads12_straddling_bm16": (
        dict(seed=8, ctx_lens=[7, 3, 20], new_counts=[5, 9, 1], heads=12), dict(block_m=16, pack_heads=True)
    ),
    "heads12_straddling_split3_qctx": (
        dict(seed=9, ctx_lens=[7, 3, 20], new_counts=[5, 9, 1], heads=12, with_query_ctx=True),
        dict(num_splits=3, pack_heads=True),
    ),
    # Small grids pad each token's 12 heads to 16 rows (the padding rows read and write nothing).
    "heads12_padded_split3_qctx": (
        dict(seed=10, ctx_lens=[7, 3, 20], new_counts=[5, 9, 1], heads=12, with_query_ctx=True),
        dict(num_splits=3, pack_heads=False),
    ),
    "heads12_padded_bm16": (dict(seed=11, ctx_lens=[21, 4], new_counts=[7, 2], heads=12), dict(block_m=16, pack_heads=False)),
    "tree_fp16": (
        dict(seed=7, ctx_lens=[3, 21], new_counts=[5, 7], dtype=torch.float16, rank=32), {}
    ),
}
INTERPRETED_FUSED = [k for k in FUSED_CASES if not k.startswith("bf16")]  # see above: bf16 on GPU
COMPACTION_CASES = [
    "chain_overlap", "chain_reversed", "tiles_of_4_mixed", "random_batch_bf16", "zero_only",
]


def _attention_case(case_kw: dict, kernel_kw: dict) -> tuple[float, float]:
    from engine.attention.reference import paged_mla_attention
    from engine.kernels.tree_mla_attention import tree_mla_attention
    from tests.engine.kernels.cases import make_case, naive_attention

    case = make_case(**case_kw)
    ref = paged_mla_attention(*case.args(), query_ctx_lens=case.query_ctx_lens)  # [N, H, R]
    got = tree_mla_attention(*case.args(), query_ctx_lens=case.query_ctx_lens, **kernel_kw)
    assert got.dtype == case.q_latent.dtype and got.shape == ref.shape
    naive = naive_attention(case)  # [N, H, R] float64
    tol = 1e-5 if case.q_latent.dtype == torch.float32 else 5e-3
    err = max((got.double() - ref.double()).abs().max().item(),
              (got.double() - naive).abs().max().item())
    return err, tol


def _compaction_case(name: str) -> tuple[float, float]:
    from engine.kernels.compaction import compact_and_zero_triton
    from engine.kv.compaction import compact_and_zero_reference

    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    kv = torch.randn(3, 6, 4, 20, generator=gen).to(dtype)  # [L, blocks, block_size, D]
    if name == "chain_overlap":
        src, dst, zero = [5, 7], [4, 5], [6, 7, 9]
    elif name == "chain_reversed":  # the second move reads what the first wrote
        src, dst, zero = [7, 5], [5, 4], [8]
    elif name == "tiles_of_4_mixed":  # tile 0 clashes (replayed), tile 1 reads tile 0's write
        src, dst, zero = [10, 3, 12, 9, 20, 10, 23, 21], [9, 2, 10, 8, 19, 7, 22, 20], [3, 23]
    elif name == "zero_only":
        src, dst, zero = [], [], [0, 3, 23]
    else:  # three sequences, accepted paths moved down, rejected tree slots zeroed
        rng = random.Random(3)
        src, dst, zero = [], [], []
        for ctx in (0, 8, 16):
            nodes = list(range(1, 7))
            path = sorted(rng.sample(nodes, 3))
            src += [ctx + i for i in path]
            dst += [ctx + 1 + k for k in range(3)]
            zero += [ctx + i for i in nodes if ctx + i not in dst[-3:]]
    want, got = kv.clone(), kv.clone()
    flat = want.view(3, -1, 20)  # [L, slots, D]: naive in-order replay
    for s, d in zip(src, dst, strict=True):
        flat[:, d] = flat[:, s]
    flat[:, zero] = 0
    slots = [torch.tensor(xs, dtype=torch.int64) for xs in (src, dst, zero)]  # [K], [K], [Z]
    compact_and_zero_triton(got, *slots, block_k=4 if name.startswith("tiles") else 32)
    ref = kv.clone()
    compact_and_zero_reference(ref, *slots)
    raw = torch.int32 if dtype == torch.float32 else torch.int16  # compare bit patterns
    same = torch.equal(got.view(raw), want.view(raw))
    same_ref = torch.equal(got, ref)
    return (0.0 if same and same_ref else 1.0), 0.0


def run_all() -> dict[str, dict]:
    results: dict[str, dict] = {}
    jobs: dict[str, Callable[[], tuple[float, float]]] = {
        **{f"attention/{k}": (lambda v=v: _attention_case(*v)) for k, v in ATTENTION_CASES.items()},
        **{f"compaction/{k}": (lambda k=k: _compaction_case(k)) for k in COMPACTION_CASES},
        **{f"rms_norm/{k}": (lambda k=k: check_rms_norm(k, "cpu")) for k in INTERPRETED_FUSED},
        **{f"rope_latent/{k}": (lambda k=k: check_rope_latent(k, "cpu")) for k in INTERPRETED_FUSED},
        **{f"mtp_input/{k}": (lambda k=k: check_mtp_input(k, "cpu")) for k in INTERPRETED_FUSED},
        **{f"silu_mul/{k}": (lambda k=k: check_silu_mul(k, "cpu")) for k in INTERPRETED_FUSED},
        **{f"add_rms_norm/{k}": (lambda k=k: check_add_rms_norm(k, "cpu")) for k in INTERPRETED_FUSED},
        "draft_layer/rope_fp32": lambda: check_draft_rope("cpu", torch.float32),
        "draft_layer/rope_fp16": lambda: check_draft_rope("cpu", torch.float16),
        "draft_layer/scaled_silu_mul_fp32": lambda: check_scaled_silu_mul("cpu", torch.float32),
        "draft_layer/fp32_fused": lambda: check_draft_layer("cpu", torch.float32, True),
        "accept/greedy_random_trees": lambda: check_accept_greedy("cpu"),
        "accept/logprob_topk": lambda: check_logprob_topk("cpu"),
        "accept/race_draw": lambda: check_race_draw("cpu"),
        "accept/sampled_random_trees": lambda: check_accept_sampled("cpu"),
        "tree/grow_frontier": lambda: check_grow_frontier("cpu"),
        "tree/select": lambda: check_select_tree("cpu"),
        "tree/mtp_rows": lambda: check_mtp_rows("cpu"),
        "tree/commit_kv": lambda: check_tree_commit("cpu"),
        "step_io/step_start": lambda: check_step_start("cpu"),
        "step_io/verify_inputs": lambda: check_verify_inputs("cpu"),
        "step_io/zero_cache_rows": lambda: check_zero_cache_rows("cpu"),
        "step_io/advance": lambda: check_advance("cpu"),
        "step_io/write_outputs": lambda: check_write_outputs("cpu"),
        "step_io/mtp_input_parts": lambda: check_mtp_input_parts("cpu"),
        "step_io/engine_greedy": lambda: check_engine_greedy("cpu"),
    }
    for name, job in jobs.items():
        try:
            err, tol = job()
            results[name] = {"err": err, "tol": tol}
        except Exception:  # reported per case to the pytest side
            results[name] = {"error": traceback.format_exc(limit=6)}
    return results


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    assert "triton" not in sys.modules, "TRITON_INTERPRET must be set before triton is imported"
    print(json.dumps(run_all()))


if __name__ == "__main__":
    main()
