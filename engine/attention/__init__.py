"""Paged absorbed-MLA attention over the latent KV cache (contract: docs/internals.md).

``paged_mla_attention`` runs the Triton kernel (``engine/kernels/tree_mla_attention.py``) when
the tensors live on a CUDA device and Triton is installed, and the PyTorch reference
(``engine/attention/reference.py``) otherwise. Both take the same arguments and agree to
floating-point tolerance. ``memo`` (a dict that lives as long as the batch, e.g.
``AttentionBatch.memo``) lets the reference build its layer-independent ``AttentionPlan`` once
per forward instead of once per layer.
"""

from __future__ import annotations

from torch import Tensor

from engine.attention.reference import attention_plan, slot_mapping_for, write_kv
from engine.attention.reference import paged_mla_attention as paged_mla_attention_reference
from engine.kernels import triton_available

__all__ = [
    "paged_mla_attention",
    "paged_mla_attention_reference",
    "slot_mapping_for",
    "write_kv",
]


def paged_mla_attention(
    q_latent: Tensor,  # [N, H, R]
    q_rope: Tensor,  # [N, H, P]
    kv_cache: Tensor,  # [num_blocks, block_size, R + P]
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    ctx_lens: Tensor,  # [B] int32
    query_start: Tensor,  # [B + 1] int32
    new_mask: Tensor,  # [N, M] bool
    scale: float,
    query_ctx_lens: Tensor | None = None,  # [N] int32, None = every committed key
    memo: dict[object, object] | None = None,  # per-batch cache of the reference's plan
) -> Tensor:  # [N, H, R]
    """Dispatch to the Triton kernel on CUDA, else to the PyTorch reference."""
    if q_latent.is_cuda and triton_available():
        from engine.kernels.tree_mla_attention import tree_mla_attention

        return tree_mla_attention(
            q_latent, q_rope, kv_cache, block_tables, ctx_lens, query_start, new_mask, scale,
            query_ctx_lens=query_ctx_lens,
        )
    plan = None
    if memo is not None:
        key = ("reference_plan", q_latent.shape[1], kv_cache.shape[1])  # heads, block size
        plan = memo.get(key)
        if plan is None:
            plan = memo[key] = attention_plan(
                block_tables, ctx_lens, query_start, new_mask, q_latent.shape[1], kv_cache.shape[1],
                query_ctx_lens,
            )  # fmt: skip
    return paged_mla_attention_reference(
        q_latent, q_rope, kv_cache, block_tables, ctx_lens, query_start, new_mask, scale,
        query_ctx_lens=query_ctx_lens, plan=plan,  # type: ignore[arg-type]
    )
