"""Fused Triton kernel: an MTP forward's input rows gathered from the parts they come in.

A drafting depth of the graphed tree step (``engine.spec.graphed_tree``) runs its MTP module
over rows that come in parts: the catch-up tokens and then the frontier's, the carried row,
the previous depth's outputs and then the frontier's hidden states. Concatenating them first
took two kernels per depth (three depths of the gpu preset's tree); here the input kernel reads
each row where it lies, so the concatenations are gone. It computes what
``engine.kernels.fused_layers.mtp_input`` computes on the concatenated rows:
``[enorm(embed(token)) | hnorm(prev)]`` per row.

Grid ``(B * R,)``: program ``row`` is row ``j = row % R`` of sequence ``b = row // R``; its
token is part 0's column ``j`` or part 1's column ``j - T0``; its previous hidden state is
part 0's row ``j``, part 1's row ``j - P0`` or part 2's row ``j - P0 - P1``. Every part is
``[B, rows, ...]`` with its own batch and row strides (a row stride of 0 repeats one row: the
first depth's frontier is the root's row ``K`` times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.fused_layers import _norm_row


@triton.jit
def _mtp_input_parts_kernel(
    tok0_ptr, tok1_ptr, stride_t0, stride_t1, T0,  # token parts [B, T_i] (columns contiguous)
    prev0_ptr, prev1_ptr, prev2_ptr,  # hidden parts [B, P_i, H] (last dim contiguous)
    stride_p0b, stride_p0r, stride_p1b, stride_p1r, stride_p2b, stride_p2r, P0, P1,
    emb_ptr, ew_ptr, hw_ptr, out_ptr,  # [V, H], [H], [H], [B * R, 2H]
    R, stride_emb, D, eps_e, eps_h, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // R
    j = row % R
    if j < T0:
        token = tl.load(tok0_ptr + b * stride_t0 + j)
    else:
        token = tl.load(tok1_ptr + b * stride_t1 + (j - T0))
    if j < P0:
        prev = prev0_ptr + b * stride_p0b + j * stride_p0r
    elif j < P0 + P1:
        prev = prev1_ptr + b * stride_p1b + (j - P0) * stride_p1r
    else:
        prev = prev2_ptr + b * stride_p2b + (j - P0 - P1) * stride_p2r
    out_row = out_ptr + row * 2 * D
    _norm_row(emb_ptr + token.to(tl.int64) * stride_emb, ew_ptr, out_row, D, eps_e, BLOCK)
    _norm_row(prev, hw_ptr, out_row + D, D, eps_h, BLOCK)


def mtp_input_parts(
    token_parts: list[Tensor],  # 1 or 2 of [B, T_i] int64, columns contiguous
    prev_parts: list[Tensor],  # 1 to 3 of [B, P_i, H], last dim contiguous
    embed_weight: Tensor,  # [V, H]
    enorm_weight: Tensor,  # [H]
    enorm_eps: float,
    hnorm_weight: Tensor,  # [H]
    hnorm_eps: float,
) -> Tensor:  # [B * R, 2H], R = sum T_i = sum P_i
    """``mtp_input(cat(token_parts, 1).reshape(-1), cat(prev_parts, 1).reshape(-1, H), ...)``
    without the concatenations (see the module docstring)."""
    assert 1 <= len(token_parts) <= 2 and 1 <= len(prev_parts) <= 3
    B = prev_parts[0].shape[0]
    H = prev_parts[0].shape[-1]
    R = sum(p.shape[1] for p in prev_parts)
    assert sum(t.shape[1] for t in token_parts) == R and embed_weight.stride(-1) == 1
    assert all(t.stride(-1) == 1 for t in token_parts) and all(p.stride(-1) == 1 for p in prev_parts)
    toks = [*token_parts, token_parts[-1]][:2]  # unused parts: any valid tensor (never read)
    prevs = [*prev_parts, prev_parts[-1], prev_parts[-1]][:3]
    counts = [p.shape[1] for p in prev_parts] + [0, 0]
    out = torch.empty(B * R, 2 * H, dtype=prev_parts[0].dtype, device=prev_parts[0].device)
    if B * R:
        _mtp_input_parts_kernel[(B * R,)](
            toks[0], toks[1], toks[0].stride(0), toks[1].stride(0), token_parts[0].shape[1],
            prevs[0], prevs[1], prevs[2],
            prevs[0].stride(0), prevs[0].stride(1), prevs[1].stride(0), prevs[1].stride(1),
            prevs[2].stride(0), prevs[2].stride(1), counts[0], counts[1],
            embed_weight, enorm_weight, hnorm_weight, out,
            R, embed_weight.stride(0), H, enorm_eps, hnorm_eps, BLOCK=triton.next_power_of_2(H),
        )  # fmt: skip
    return out
