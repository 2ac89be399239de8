"""Compiled Triton kernels on a CUDA GPU vs the PyTorch references (skipped without CUDA)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from torch.testing import assert_close

from engine.attention import paged_mla_attention, paged_mla_attention_reference
from engine.kv.compaction import compact_and_zero
from tests.engine.kernels.cases import make_case
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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

# (heads, block_size, ctx_lens, new_counts, mask_kind): published-model latent sizes R=512, P=64.
SHAPES = [
    (16, 64, [0, 100, 700, 2048], [16, 1, 64, 8], "tree"),
    (128, 64, [513, 37], [8, 1], "tree"),
    (16, 16, [5, 300], [128, 40], "causal"),
    (128, 64, [2000], [1], "causal"),  # batch-1 decode: split-K path
]


@pytest.mark.parametrize(("heads", "block_size", "ctx_lens", "new_counts", "mask_kind"), SHAPES)
@pytest.mark.parametrize("kernel_kw", [{}, {"block_m": 32}, {"num_splits": 4}])
def test_bf16_kernel_matches_reference(
    heads: int, block_size: int, ctx_lens: list[int], new_counts: list[int], mask_kind: str,
    kernel_kw: dict,
) -> None:
    from engine.kernels.tree_mla_attention import tree_mla_attention

    seed = random.randrange(1 << 30)  # fresh inputs each run; the seed is in the message
    case = make_case(seed, ctx_lens, new_counts, mask_kind=mask_kind, heads=heads, rank=512,
                     rope=64, block_size=block_size, dtype=torch.bfloat16, device="cuda")
    ref = paged_mla_attention_reference(*case.args())  # [N, H, R], float32 math inside
    got = tree_mla_attention(*case.args(), **kernel_kw)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize(("ctx_lens", "new_counts", "mask_kind"), [
    ([130, 64, 7, 300], [33, 33, 33, 33], "tree"), ([128, 90], [5, 1], "causal"), ([0, 40], [13, 13], "tree"),
])  # fmt: skip
def test_bf16_default_tile_at_the_gpu_presets_sizes(ctx_lens: list[int], new_counts: list[int], mask_kind: str) -> None:
    """The gpu preset's latent (H=12, R=256, P=32, page 16) runs ``default_tile``'s 64-row tile
    (rows packed token x 12 heads, so tiles straddle tokens): trees, chains and decode rows,
    with and without per-query contexts (the MTP rows')."""
    from engine.kernels.tree_mla_attention import default_tile, tree_mla_attention

    assert default_tile(256).block_m == 64
    seed = random.randrange(1 << 30)
    for with_qctx in (False, True):
        case = make_case(seed, ctx_lens, new_counts, mask_kind=mask_kind, heads=12, rank=256, rope=32,
                         block_size=16, dtype=torch.bfloat16, device="cuda", with_query_ctx=with_qctx)
        qctx = case.query_ctx_lens if with_qctx else None
        ref = paged_mla_attention_reference(*case.args(), query_ctx_lens=qctx)
        for pack_heads in (None, True, False):  # the grid's choice, then each layout
            got = tree_mla_attention(*case.args(), query_ctx_lens=qctx, pack_heads=pack_heads)
            assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2,
                         msg=lambda m, p=pack_heads: f"seed {seed}, pack_heads {p}: {m}")  # fmt: skip


def test_fp32_kernel_is_tight_and_dispatch_uses_it() -> None:
    from engine.kernels.tree_mla_attention import tree_mla_attention

    case = make_case(3, [0, 33, 90], [5, 9, 1], heads=8, rank=64, rope=16, block_size=16,
                     with_query_ctx=True, device="cuda")
    ref = paged_mla_attention_reference(*case.args(), query_ctx_lens=case.query_ctx_lens)
    got = tree_mla_attention(*case.args(), query_ctx_lens=case.query_ctx_lens)
    assert_close(got, ref, atol=1e-5, rtol=1e-5)
    dispatched = paged_mla_attention(*case.args(), query_ctx_lens=case.query_ctx_lens)
    assert torch.equal(dispatched, got)


def test_fused_compaction_is_bit_exact_on_gpu() -> None:
    rng = random.Random(0)
    layers, blocks, block_size, dim = 4, 64, 64, 576
    cache = torch.randn(layers, blocks, block_size, dim, device="cuda").to(torch.bfloat16)
    src, dst, zero = [5, 7], [4, 5], [6, 7]  # an overlapping chain first
    for ctx in range(64, 64 * 60, 64):  # then one tree of 16 nodes per sequence
        path = sorted(rng.sample(range(1, 16), rng.randrange(0, 6)))
        src += [ctx + i for i in path]
        dst += [ctx + 1 + k for k in range(len(path))]
        zero += [ctx + i for i in range(1, 16) if ctx + i not in dst[len(dst) - len(path):]]
    want = cache.clone()
    flat = want.view(layers, -1, dim)  # [L, slots, D]
    for s, d in zip(src, dst, strict=True):
        flat[:, d] = flat[:, s]
    flat[:, zero] = 0
    as_long = [torch.tensor(x, dtype=torch.int64, device="cuda") for x in (src, dst, zero)]
    compact_and_zero(cache, *as_long)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_layer_kernels_match_the_pytorch_path(name: str) -> None:
    for check in (check_rms_norm, check_rope_latent, check_mtp_input, check_silu_mul,
                  check_add_rms_norm):
        err, tol = check(name, "cuda")
        assert err <= tol, (check.__name__, err, tol)


def test_fused_greedy_acceptance_equals_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.accept_cases import check_accept_greedy

    err, tol = check_accept_greedy("cuda")
    assert err <= tol, "the fused acceptance kernel differs from accept_greedy_torch"


def test_fused_sampled_acceptance_equals_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.accept_cases import check_accept_sampled

    share, tol = check_accept_sampled("cuda")
    assert share <= tol, f"the fused sampled acceptance differs on {share:.1%} of the trees"


def test_fused_tree_growth_equals_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.tree_build_cases import check_grow_frontier

    err, tol = check_grow_frontier("cuda")
    assert err <= tol, "the fused growth of a depth differs from grow_frontier_torch"


def test_fused_tree_selection_equals_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.tree_build_cases import check_select_tree

    err, tol = check_select_tree("cuda")
    assert err <= tol, "the fused selection differs from select_tree_torch"


def test_fused_mtp_forward_inputs_equal_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.tree_build_cases import check_mtp_rows

    err, tol = check_mtp_rows("cuda")
    assert err <= tol, "the fused MTP forward inputs differ from RowPlan.inputs_torch"


def test_fused_logprob_topk_equals_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.accept_cases import check_logprob_topk

    err, tol = check_logprob_topk("cuda")
    assert err <= tol, err


def test_fused_race_draw_equals_the_torch_ops_on_gpu() -> None:
    from tests.engine.kernels.accept_cases import check_race_draw

    err, tol = check_race_draw("cuda")
    assert err <= tol, err


def test_race_draw_programs_compiled_at_warm_up_serve_any_draws_and_group_size_on_gpu() -> None:
    """After ``warm_race_draw`` no draw compiles another program: not the tree's four draws,
    not the verify law's none, not a batch's rows per temperature, with or without top-k /
    top-p (a compile would make a request wait seconds)."""
    from engine.kernels.race_draw import _race_draw_kernel
    from engine.spec.device_tree import race_draw, warm_race_draw

    dev = torch.device("cuda")
    warm_race_draw(dev, 8192, torch.bfloat16)
    caches = getattr(_race_draw_kernel, "device_caches", {})
    if not caches or not all(isinstance(c[0], dict) for c in caches.values()):
        pytest.skip("this Triton keeps no per-device program cache to count")

    def compiled() -> int:
        return sum(len(c[0]) for c in caches.values())

    before = compiled()
    logits = torch.randn(12, 8192, device=dev, dtype=torch.bfloat16)  # [12, V]
    for k, per in ((0, 3), (1, 12), (4, 4), (2, 6), (3, 1)):
        groups = 12 // per
        temperature = torch.full((groups,), 0.8, device=dev)
        race_draw(logits, temperature, per, k)
        race_draw(logits, temperature, per, k, None, torch.full((groups,), 5, dtype=torch.int32, device=dev),
                  torch.full((groups,), 0.9, device=dev))  # fmt: skip
    torch.cuda.synchronize()
    assert compiled() == before


def test_fused_tree_commit_is_bit_exact_on_gpu() -> None:
    from tests.engine.kernels.commit_cases import check_tree_commit

    bad, _ = check_tree_commit("cuda")
    assert bad == 0, f"the fused tree KV commit differs from the replay in {bad:.0f} cases"


@pytest.mark.parametrize("name", ["step_start", "verify_inputs", "zero_cache_rows", "advance", "write_outputs"])
def test_fused_step_bookkeeping_equals_the_torch_ops_on_gpu(name: str) -> None:
    from tests.engine.kernels import step_io_cases

    bad, _ = getattr(step_io_cases, f"check_{name}")("cuda")
    assert bad == 0, f"the fused {name} kernel differs from the torch ops in {bad:.0f} cases"


def test_mtp_input_from_parts_matches_the_concatenated_rows_on_gpu() -> None:
    from tests.engine.kernels.step_io_cases import check_mtp_input_parts

    err, tol = check_mtp_input_parts("cuda")
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


def test_graphed_tree_step_with_the_fused_bookkeeping_decodes_like_the_unfused_one_on_gpu() -> None:
    from tests.engine.kernels.step_io_cases import check_engine_greedy

    code, _ = check_engine_greedy("cuda")
    reasons = {1.0: "a token differs from autoregressive decoding",
               2.0: "acceptance counts differ from the unfused step's",
               3.0: "the graphed step did not carry the decode", 4.0: "padding left scratch entries"}
    assert code == 0, reasons.get(code, code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafting_layer_kernels_match_their_pytorch_forms_on_gpu(dtype: torch.dtype) -> None:
    for check in (check_draft_rope, check_scaled_silu_mul):
        err, tol = check("cuda", dtype)
        assert err <= tol, (check.__name__, err, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafting_layer_computes_the_mtp_layer_on_gpu(dtype: torch.dtype) -> None:
    err, tol = check_draft_layer("cuda", dtype, fused=True)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def test_greedy_decoding_with_the_drafting_layer_equals_autoregressive_on_gpu() -> None:
    from tests.engine.kernels.draft_cases import check_engine_with_drafting_layer

    code, _ = check_engine_with_drafting_layer("cuda")
    reasons = {1.0: "a token differs from autoregressive decoding", 2.0: "the drafting layer did not serve",
               3.0: "it accepted under 90% of the layer path's tokens"}  # fmt: skip
    assert code == 0, reasons.get(code, code)
