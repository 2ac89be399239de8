"""Compile the Triton kernels for sm_90 (H100/H200) without a GPU, with Triton's bundled ptxas.

Run as ``python -m tests.engine.kernels.sm90_compile_checks`` (``TRITON_INTERPRET`` unset): it
prints one JSON object ``{variant: {"shared": bytes, "registers": n, "spill_bytes": n} |
{"error": str}}``. This catches what the interpreter cannot (type and layout errors in the real
compiler, shared-memory overflow, register spills) before the kernels reach a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import traceback
from typing import Any

# variant -> (kernel, constexprs, num_warps, num_stages); bf16 unless the variant says fp32
VARIANTS: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "attention_default_h128": ("attention", dict(
        H=128, HEAD_STRIDE=128, BLOCK_M=16, BLOCK_N=32, NUM_SPLITS=1, HAS_QCTX=False, TILE_IN_PAGE=True,
    ), 8, 2),
    "attention_split4_qctx": ("attention", dict(
        H=128, HEAD_STRIDE=128, BLOCK_M=16, BLOCK_N=32, NUM_SPLITS=4, HAS_QCTX=True, TILE_IN_PAGE=True,
    ), 8, 2),
    "attention_h4_gather": ("attention", dict(
        H=4, HEAD_STRIDE=4, BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=1, HAS_QCTX=False, TILE_IN_PAGE=False,
    ), 8, 2),
    # The default tile at the gpu preset's sizes (H=12, R=256, P=32): 64 rows, packed token x
    # head on large grids, each token's heads padded to 16 rows on small (split) ones.
    "attention_r256_default": ("attention", dict(
        H=12, HEAD_STRIDE=12, BLOCK_M=64, BLOCK_N=16, NUM_SPLITS=1, HAS_QCTX=True, TILE_IN_PAGE=True,
        BLOCK_R=256, BLOCK_P=32,
    ), 4, 2),
    "attention_r256_padded_split": ("attention", dict(
        H=12, HEAD_STRIDE=16, BLOCK_M=64, BLOCK_N=16, NUM_SPLITS=16, HAS_QCTX=True, TILE_IN_PAGE=True,
        BLOCK_R=256, BLOCK_P=32,
    ), 4, 2),
    "attention_fp32_ieee": ("attention", dict(
        H=16, HEAD_STRIDE=16, BLOCK_M=16, BLOCK_N=32, NUM_SPLITS=1, HAS_QCTX=False, TILE_IN_PAGE=True,
    ), 8, 2),
    "combine_splits": ("combine", dict(NUM_SPLITS=16, BLOCK_S=16, BLOCK_R=512), 4, 1),
    "compaction": ("compaction", dict(BLOCK_D=64, BLOCK_K=32, BLOCK_Z=32), 4, 1),
    # The graphed greedy tree's building kernels at the gpu preset's tree (4 x 6, 32 nodes:
    # 84 candidates) and a wider one (8 x 6, 64 nodes: 328 candidates).
    "tree_rank_84": ("tree_rank", dict(N=32, BLOCK_T=128, CHUNK=32), 4, 1),
    "tree_rank_328": ("tree_rank", dict(N=64, BLOCK_T=512, CHUNK=32), 8, 1),
    "tree_tables_32": ("tree_tables", dict(N=32, DEPTH=6, BLOCK_N=64), 8, 1),
    "tree_tables_64": ("tree_tables", dict(N=64, DEPTH=6, BLOCK_N=128), 8, 1),
    "tree_grow_k4": ("tree_grow", dict(K=4, BLOCK_KK=16, BLOCK_H=1024), 4, 1),
    "tree_mtp_rows": ("tree_mtp_rows", dict(BLOCK_R=16, POS=0, WIN=1, QON=2, QOFF=3, KEEP=4), 4, 1),
    "mtp_input_h768": ("step_mtp_parts", dict(BLOCK=1024), 4, 1),  # the gpu preset's hidden size
    "silu_mul_1024": ("silu_mul", dict(BLOCK=1024), 4, 1),
    "add_rms_norm_h768": ("add_rms_norm", dict(BLOCK=1024), 4, 1),
    # The tree step's bookkeeping (``engine.kernels.tree_step_io``) at the gpu preset's sizes.
    "step_start": ("step_start", dict(BLOCK_SIZE=16, BLOCK_W=64), 4, 1),
    "step_verify_inputs": ("step_verify", dict(BLOCK_T=64), 4, 1),
    "step_zero_rows": ("step_zero", dict(BLOCK_N=32, BLOCK_D=256), 4, 1),
    "step_advance": ("step_advance", dict(D=6, BLOCK_C=16, BLOCK=1024), 4, 1),
    "step_write_outputs": ("step_write", dict(P=7, BLOCK_P=8, BLOCK_H=1024), 4, 1),
    # The RoPE + latent-store kernels at the gpu preset's sizes (12 heads, R=256, rope 32,
    # q LoRA 384, hidden 768): the layer path's and the drafting layer's.
    "rope_latent_gpu": ("rope_latent", dict(NOPE=64, HALF=16, R=256, BLOCK_H=16, BLOCK_R=256,
                                            INTERLEAVE=True), 4, 1),
    "draft_rope_gpu": ("draft_rope", dict(R=256, HALF=16, BLOCK_H=16, BLOCK_R=256, BLOCK_LORA=512,
                                          BLOCK_D=1024, INTERLEAVE=True), 4, 1),
    "scaled_silu_mul_gpu": ("scaled_silu", dict(BLOCK=1024, BLOCK_D=1024), 4, 1),
    # The sampled drafting depth's law and exponential race at the gpu preset's vocabulary
    # (8192: a row in registers at 8 warps; the draws a runtime count, one program for the
    # chain's one, the tree's four and the verify law's none), and with top-k / top-p (the
    # row sorted in registers, 32 keys a thread: no spill with the draws a runtime count; with
    # them a constexpr it spilled 12-56 bytes, sorting packed int64 keys 176-204).
    "race_draw_v8192": ("race_draw", dict(FILTER=False, BLOCK=8192), 8, 1),
    "race_draw_v8192_filter": ("race_draw", dict(FILTER=True, BLOCK=8192), 8, 1),
    # Sampled acceptance (its passes under branches on the walk's state): a chain of 6 and the
    # default sampled tree's widest level.
    "accept_sampled_chain6": ("accept_sampled", dict(DEPTH=6, WIDTH=1, BLOCK_V=1024), 4, 1),
    "accept_sampled_tree": ("accept_sampled", dict(DEPTH=6, WIDTH=4, BLOCK_V=1024), 4, 1),
}
NO_SPILL = ["attention_default_h128", "attention_split4_qctx", "compaction", "tree_rank_84",
            "tree_tables_32", "tree_grow_k4", "tree_mtp_rows", "mtp_input_h768", "silu_mul_1024", "add_rms_norm_h768",
            "step_start", "step_verify_inputs", "step_zero_rows", "step_advance", "step_write_outputs",
            "rope_latent_gpu", "draft_rope_gpu", "scaled_silu_mul_gpu", "race_draw_v8192",
            "race_draw_v8192_filter", "accept_sampled_chain6", "accept_sampled_tree"]
# Variants allowed a few spilled bytes: the R=256 default tile spills 584 bytes at 4 warps with
# rows packed token x 12 heads (its float32 accumulator and bfloat16 queries take 192 of 255
# registers) and 340 with each token's heads padded to 16 rows (the small grids' layout); it was
# still the fastest measured on the H200 (``default_tile``, against 8 warps and wider tiles).
SPILL_LIMIT = {"attention_r256_default": 704, "attention_r256_padded_split": 448}
# Argument types of the tree kernels (the others' follow from their names, ``_arg_type``).
TREE_TYPES = {"score_ptr": "*fp32", "tie_ptr": "*fp64", "front_score_ptr": "*fp32", "logp_ptr": "*fp32",
              "new_score_ptr": "*fp32", "hidden_ptr": "*bf16", "new_hidden_ptr": "*bf16", "mask_ptr": "*i1",
              "new_mask_ptr": "*i1", "ctx_ptr": "*i32", "qctx_ptr": "*i32", "trash": "i64"}
STEP_TYPES = {"tables_ptr": "*i32", "kv_ptr": "*bf16", "live_ptr": "*i1", "next_rows_ptr": "*bf16",
              "rows0_ptr": "*bf16", "next_carry_ptr": "*bf16", "carry_ptr": "*bf16",
              "child_ptr": "*i1", "keep_ptr": "*i1", "keep_out_ptr": "*i1", "hidden_ptr": "*bf16",
              "ctx_ptr": "*i32", "prev0_ptr": "*bf16", "prev1_ptr": "*bf16", "prev2_ptr": "*bf16",
              "emb_ptr": "*bf16", "ew_ptr": "*bf16", "hw_ptr": "*bf16", "out_ptr": "*bf16",
              "eps_e": "fp32", "eps_h": "fp32"}
RACE_TYPES = {"x_ptr": "*bf16", "temp_ptr": "*fp32", "topk_ptr": "*i32", "topp_ptr": "*fp32", "noise_ptr": "*fp32",
              "V": "i32", "rows_per_temp": "i32", "K": "i32", "q_ptr": "*fp32",
              "key_ptr": "*fp32", "idx_ptr": "*i64"}
ACCEPT_TYPES = {"tok_ptr": "*i64", "valid_ptr": "*u8", "child_ptr": "*i64", "qrow_ptr": "*i64",
                "num_ptr": "*i64", "path_ptr": "*i64", "bonus_ptr": "*i64"}
# Argument types of the RoPE kernels' non-bf16 arguments (the rest: ``_arg_type``).
ROPE_TYPES = {"pos_ptr": "*i64", "slot_ptr": "*i64", "inv_freq_ptr": "*fp32", "attention_factor": "fp32",
              "eps_x": "fp32", "eps_q": "fp32", "eps_kv": "fp32"}


def _arg_type(name: str, fp32: bool) -> str:
    """Triton signature type of a kernel argument, from its name."""
    if name in ("bt_ptr", "ctx_ptr", "qs_ptr", "qctx_ptr"):
        return "*i32"
    if name == "ids_ptr":
        return "*i64"
    if name == "mask_ptr":
        return "*u8"
    if name in ("part_acc_ptr", "part_ml_ptr"):
        return "*fp32"
    if name in ("src_ptr", "dst_ptr", "zero_ptr"):
        return "*i64"
    if name.endswith("_ptr"):
        return "*fp32" if fp32 else "*bf16"
    if name in ("qk_scale", "eps", "eps_e", "eps_h"):
        return "fp32"
    if name.startswith("stride"):
        return "i64"
    return "i32"


def compile_variant(name: str) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.compaction import _compact_and_zero_kernel
    from engine.kernels.draft_layer_kernels import _draft_rope_kernel, _scaled_silu_mul_kernel
    from engine.kernels.fused_layers import (
        _add_rms_norm_kernel,
        _mtp_input_kernel,
        _rope_latent_kernel,
        _silu_mul_kernel,
    )
    from engine.kernels.mtp_rows import _mtp_rows_kernel
    from engine.kernels.race_draw import _race_draw_kernel
    from engine.kernels.sampled_accept import _accept_sampled_kernel
    from engine.kernels.tree_grow import _grow_kernel
    from engine.kernels.tree_mla_attention import _combine_splits_kernel, _tree_mla_fwd_kernel
    from engine.kernels.tree_select import _rank_kernel, _tables_kernel
    from engine.kernels.tree_step_io import (
        _advance_kernel,
        _step_start_kernel,
        _verify_inputs_kernel,
        _write_outputs_kernel,
        _zero_cache_rows_kernel,
    )

    kind, consts, num_warps, num_stages = VARIANTS[name]
    fn = {"attention": _tree_mla_fwd_kernel, "combine": _combine_splits_kernel,
          "compaction": _compact_and_zero_kernel, "tree_rank": _rank_kernel,
          "tree_tables": _tables_kernel, "tree_grow": _grow_kernel, "tree_mtp_rows": _mtp_rows_kernel,
          "silu_mul": _silu_mul_kernel,
          "add_rms_norm": _add_rms_norm_kernel, "step_start": _step_start_kernel,
          "step_verify": _verify_inputs_kernel,
          "step_zero": _zero_cache_rows_kernel, "step_advance": _advance_kernel,
          "step_write": _write_outputs_kernel, "step_mtp_parts": _mtp_input_kernel,
          "rope_latent": _rope_latent_kernel, "draft_rope": _draft_rope_kernel,
          "scaled_silu": _scaled_silu_mul_kernel, "race_draw": _race_draw_kernel,
          "accept_sampled": _accept_sampled_kernel}[kind]  # fmt: skip
    fp32 = name.endswith("fp32_ieee")
    if kind == "attention":
        consts = {"BLOCK_R": 512, "BLOCK_P": 64, **consts,
                  "DOT_PRECISION": "ieee" if fp32 else "tf32"}

    def arg_type(arg: str) -> str:
        if kind.startswith("step_"):  # int64 pointers but for the typed ones, int32 sizes
            return STEP_TYPES.get(arg, "*i64" if arg.endswith("_ptr") else "i64" if arg.startswith("stride") else "i32")
        if kind == "race_draw" and arg in RACE_TYPES:
            return RACE_TYPES[arg]
        if kind == "accept_sampled":
            return ACCEPT_TYPES.get(arg, "*fp32" if arg.endswith("_ptr") else "i32")
        if arg in ROPE_TYPES:
            return ROPE_TYPES[arg]
        if not kind.startswith("tree_"):
            return _arg_type(arg, fp32)
        if arg in TREE_TYPES:
            return TREE_TYPES[arg]
        return "*i64" if arg.endswith("_ptr") else "i64" if arg == "offset" or arg.startswith("stride") else "i32"

    signature = {a: "constexpr" if a in consts else arg_type(a) for a in fn.arg_names}
    kernel = triton.compile(
        ASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                          capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return {"shared": int(kernel.metadata.shared),
            "registers": int(registers.group(1)) if registers else -1,
            "spill_bytes": int(spills.group(1)) if spills else 0}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    results: dict[str, dict] = {}
    for name in VARIANTS:
        try:
            results[name] = compile_variant(name)
        except Exception:  # reported per variant to the pytest side
            results[name] = {"error": traceback.format_exc(limit=6)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
