"""GPU kernel check and benchmark: Triton paged tree-MLA attention and KV compaction.

Run on a CUDA machine from the repository root (imports only ``engine``, torch and triton)::

    python -m bench.gpu_kernels OUT_DIR [--quick]

1. checks: Triton vs PyTorch reference at published-model sizes (bf16, R=512, P=64,
   block_size=64), random trees, ragged contexts, shuffled blocks; compaction bit-exact;
2. sweep: a few tile configurations on two representative shapes;
3. attention: ``triton.testing.do_bench`` times for batch x tree size x context, Triton (default
   config) and the reference where it fits in memory/time;
4. compaction: time per verify step for all layers (goal: well under 0.1 ms);
5. tree commit: the graphed tree step's rollback (``commit_tree_kv``), the fused kernel against
   the PyTorch ops it replaced, each replayed as a CUDA graph, checked bit-exact, at the ``gpu``
   preset's cache and the published model's.
``--only tree_commit`` runs the last part alone (seconds). Writes ``OUT_DIR/gpu_kernels.json`` and ``OUT_DIR/gpu_kernels.log``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention.reference import paged_mla_attention as attention_reference  # noqa: E402
from engine.kv.compaction import compact_and_zero_reference  # noqa: E402

RANK, ROPE, BLOCK_SIZE = 512, 64, 64  # DeepSeek-V3 kv_lora_rank, qk_rope_head_dim; page size
SCALE = 192**-0.5  # 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
NUM_LAYERS = 62  # 61 target layers + 1 MTP layer share the cache
REF_MAX_SCORES = 1 << 31  # time the reference only below this many scores (N * H * S)


class Log:
    def __init__(self, path: Path) -> None:
        self.file = path.open("w")

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        self.file.write(msg + "\n")
        self.file.flush()


def build_attention_inputs(
    batch: int, tree: int, ctx: int, heads: int, seed: int, dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> dict[str, Any]:
    """Random verify-step inputs: ragged contexts (+-12%), shuffled blocks, random trees."""
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    jitter = torch.randint(-(ctx // 8), ctx // 8 + 1, (batch,), generator=gen)
    ctx_lens = (ctx + jitter).clamp(min=0)  # [B]
    need = (ctx_lens + tree + BLOCK_SIZE - 1) // BLOCK_SIZE  # [B] blocks per sequence
    num_blocks = int(need.sum()) + 8
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # non-contiguous ids
    max_blocks = int(need.max())
    cols = torch.arange(max_blocks)  # [max_blocks]
    first = torch.cumsum(need, 0) - need  # [B] offset of each sequence's blocks in `order`
    take = (first[:, None] + cols[None, :]).clamp(max=num_blocks - 1)  # [B, max_blocks]
    block_tables = torch.where(cols[None, :] < need[:, None], order[take], -1)  # [B, max_blocks]

    # Random trees, parents before children: row i = row(parent) | {i}.
    parents = (torch.rand(batch, tree, generator=gen) * torch.arange(tree)).long()  # [B, T]
    mask = torch.zeros(batch, tree, tree, dtype=torch.bool)  # [B, T, T]
    eye = torch.eye(tree, dtype=torch.bool)
    for i in range(tree):
        mask[:, i] = eye[i] | (mask[torch.arange(batch), parents[:, i]] if i else False)

    num_tokens = batch * tree
    gen_dev = torch.Generator(device=dev).manual_seed(seed)
    return {
        "q_latent": torch.randn(num_tokens, heads, RANK, generator=gen_dev, device=dev,
                                dtype=dtype),  # [N, H, R]
        "q_rope": torch.randn(num_tokens, heads, ROPE, generator=gen_dev, device=dev,
                              dtype=dtype),  # [N, H, P]
        "kv_cache": torch.randn(num_blocks, BLOCK_SIZE, RANK + ROPE, generator=gen_dev,
                                device=dev, dtype=dtype),  # [num_blocks, block_size, R + P]
        "block_tables": block_tables.to(dev),  # [B, max_blocks] int32
        "ctx_lens": ctx_lens.to(torch.int32).to(dev),  # [B]
        "query_start": (torch.arange(batch + 1) * tree).to(torch.int32).to(dev),  # [B + 1]
        "new_mask": mask.reshape(num_tokens, tree).to(dev),  # [N, T]
        "scale": SCALE,
    }


def bench_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def check_attention(
    log: Log, heads: int, batch: int, tree: int, ctx: int, device: str = "cuda", **kw: Any
) -> dict:
    inputs = build_attention_inputs(batch, tree, ctx, heads, seed=batch * 1000 + tree + heads,
                                    device=device)
    from engine.kernels.tree_mla_attention import tree_mla_attention

    ref = attention_reference(**inputs).float()  # [N, H, R]
    got = tree_mla_attention(**inputs, **kw).float()
    err = (got - ref).abs()
    excess = (err - (2e-2 + 2e-2 * ref.abs())).max().item()
    rec = {"heads": heads, "batch": batch, "tree": tree, "ctx": ctx, "kw": kw,
           "max_abs_err": err.max().item(), "ok": bool(excess <= 0 and torch.isfinite(got).all())}
    log(f"check attention H={heads} B={batch} T={tree} ctx={ctx} {kw}: "
        f"max_abs_err={rec['max_abs_err']:.3e} {'OK' if rec['ok'] else 'FAIL'}")
    return rec


def make_compaction_step(
    batch: int, tree: int, accepted: int, seed: int, device: str = "cuda"
) -> tuple:
    """Slots of one verify step: each sequence's tree at ctx..ctx+tree-1, a path accepted."""
    gen = torch.Generator().manual_seed(seed)
    src, dst, zero = [], [], []
    stride = -(-tree // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    for b in range(batch):
        ctx = b * stride + 17
        path = sorted(torch.randperm(tree - 1, generator=gen)[:accepted].add(1).tolist())
        moved = [ctx + 1 + k for k in range(len(path))]
        src += [ctx + i for i in path]
        dst += moved
        zero += [ctx + i for i in range(1, tree) if ctx + i not in moved]
    as_long = [torch.tensor(x, dtype=torch.int64, device=device) for x in (src, dst, zero)]
    return as_long[0], as_long[1], as_long[2], batch * stride


def run_checks(log: Log, device: str = "cuda") -> list[dict]:
    """Triton vs reference at realistic shapes, and the fused compaction bit-exact."""
    from engine.kernels.compaction import compact_and_zero_triton

    shapes: list[tuple[int, int, int, int, dict[str, Any]]] = [  # heads, batch, tree, ctx, kw
        (128, 1, 1, 2048, {}), (128, 4, 16, 512, {}), (128, 2, 64, 2048, {}),
        (16, 32, 8, 2048, {}), (16, 64, 1, 512, {}), (128, 1, 1, 2048, {"num_splits": 1}),
        (128, 8, 4, 512, {"block_m": 32}), (16, 8, 64, 512, {"block_m": 64}),
    ]
    checks = [check_attention(log, h, b, t, c, device, **kw) for h, b, t, c, kw in shapes]
    cache = torch.randn(NUM_LAYERS, 256, BLOCK_SIZE, RANK + ROPE, device=device,
                        dtype=torch.bfloat16)  # [L, blocks, block_size, D]
    src, dst, zero, _ = make_compaction_step(32, 16, 4, seed=0, device=device)
    want = cache.clone()
    compact_and_zero_reference(want, src, dst, zero)
    compact_and_zero_triton(cache, src, dst, zero)
    ok = torch.equal(cache.view(torch.int16), want.view(torch.int16))
    checks.append({"compaction_bit_exact": ok, "ok": ok})
    log(f"check compaction bit-exact (L={NUM_LAYERS}, 32 seqs, tree 16): {'OK' if ok else 'FAIL'}")
    return checks


def run_sweep(log: Log, quick: bool, device: str = "cuda") -> list[dict]:
    """A few tile configurations on a decode and a verify shape per head count."""
    from engine.kernels.tree_mla_attention import tree_mla_attention

    configs: list[dict[str, Any]] = [  # first: the kernel's default
        {"block_m": 16, "block_n": 32, "num_warps": 8, "num_stages": 2},
        {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2},
        {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2},
        {"block_m": 16, "block_n": 32, "num_warps": 8, "num_stages": 3},
        {"block_m": 32, "block_n": 32, "num_warps": 8, "num_stages": 2},
        {"block_m": 16, "block_n": 64, "num_warps": 8, "num_stages": 2},
    ]
    records = []
    for heads in (128, 16):
        for batch, tree, ctx in [(64, 1, 2048), (16, 16, 2048)]:
            inputs = build_attention_inputs(batch, tree, ctx, heads, seed=7, device=device)
            for cfg in configs[:2] if quick else configs:
                rec: dict[str, Any] = {"heads": heads, "batch": batch, "tree": tree, "ctx": ctx,
                                       **cfg}
                try:
                    rec["triton_ms"] = bench_ms(partial(tree_mla_attention, **inputs, **cfg))
                except Exception as exc:  # e.g. out of shared memory for a large tile
                    rec["error"] = repr(exc)[:300]
                records.append(rec)
                log(f"sweep {rec}")
            del inputs
    return records


def run_attention_grid(log: Log, quick: bool, device: str = "cuda") -> list[dict]:
    """Default-config Triton (and reference where it fits) over batch x tree x context."""
    from engine.kernels.tree_mla_attention import tree_mla_attention

    batches = [1, 16, 256] if quick else [1, 4, 16, 64, 256]
    trees = [1, 16, 64] if quick else [1, 4, 16, 64]
    records = []
    for heads in (128, 16):
        for ctx in (512, 2048):
            for batch in batches:
                for tree in trees:
                    inputs = build_attention_inputs(batch, tree, ctx, heads, seed=batch + tree,
                                                    device=device)
                    kv_tokens = int((inputs["ctx_lens"].sum() + batch * tree).item())
                    kv_bytes = kv_tokens * (RANK + ROPE) * 2  # every visible entry read once
                    rec: dict[str, Any] = {"heads": heads, "ctx": ctx, "batch": batch,
                                           "tree": tree, "kv_bytes": kv_bytes}
                    rec["triton_ms"] = bench_ms(partial(tree_mla_attention, **inputs))
                    rec["kv_gbps"] = kv_bytes / rec["triton_ms"] / 1e6
                    if batch * tree * heads * (ctx + ctx // 8 + tree) <= REF_MAX_SCORES:
                        rec["reference_ms"] = bench_ms(partial(attention_reference, **inputs))
                        rec["speedup"] = rec["reference_ms"] / rec["triton_ms"]
                    records.append(rec)
                    log(f"attention {rec}")
                    del inputs
            if device == "cuda":
                torch.cuda.empty_cache()
    return records


def run_compaction(log: Log, device: str = "cuda") -> list[dict]:
    """Time of one verify step's compact-and-zero over all layers."""
    from engine.kernels.compaction import compact_and_zero_triton

    cache = torch.zeros(NUM_LAYERS, 1024, BLOCK_SIZE, RANK + ROPE, device=device,
                        dtype=torch.bfloat16)  # [L, blocks, block_size, D], ~4.7 GB
    entry_bytes = NUM_LAYERS * (RANK + ROPE) * 2
    records = []
    for batch in (1, 16, 64, 256):
        for tree in (8, 64):
            src, dst, zero, span = make_compaction_step(batch, tree, min(4, tree - 1), seed=batch,
                                                        device=device)
            if span > cache.shape[1] * BLOCK_SIZE:
                continue
            traffic = (2 * src.numel() + zero.numel()) * entry_bytes  # move r+w, zero w
            rec: dict[str, Any] = {"batch": batch, "tree": tree, "moves": src.numel(),
                                   "zeroed": zero.numel(), "bytes": traffic}
            rec["triton_ms"] = bench_ms(partial(compact_and_zero_triton, cache, src, dst, zero))
            rec["reference_ms"] = bench_ms(
                partial(compact_and_zero_reference, cache, src, dst, zero))
            rec["triton_gbps"] = traffic / rec["triton_ms"] / 1e6
            records.append(rec)
            log(f"compaction {rec}")
    return records


def graph_ms(fn: Callable[[], Any], calls: int = 1) -> float:
    """Median ms of one ``fn()`` captured in a CUDA graph (as the engine runs it); ``calls``
    of them in one graph spread the replay's launch over that many."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (Triton compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return bench_ms(graph.replay) / calls


def run_tree_commit(log: Log, device: str = "cuda") -> list[dict]:
    """The rollback of a graphed tree step (33-node trees, paths of up to 6) per batch size."""
    from engine.kernels.tree_commit import commit_tree_kv_triton
    from engine.kv.compaction import commit_tree_kv_reference

    records = []
    gen = torch.Generator().manual_seed(0)
    # (name, target layers, all layers, entry width, block size): the gpu preset, DeepSeek-V3.
    for name, layers, layers_all, dim, block in [("gpu", 12, 16, 288, 16),
                                                 ("v3", NUM_LAYERS - 1, NUM_LAYERS, RANK + ROPE, 64)]:
        for batch in (1, 16, 64, 256):
            T, P = 33, 6
            blocks = batch * -(-(T + 64) // block) + 1
            cache = torch.randn(layers_all, blocks, block, dim, device=device).to(torch.bfloat16)
            slots = torch.randperm(blocks * block, generator=gen)[: batch * T].view(batch, T)
            path = torch.zeros(batch, P, dtype=torch.long)
            keep = torch.zeros(batch, P, dtype=torch.bool)
            for b in range(batch):
                a = int(torch.randint(0, P, (1,), generator=gen))
                path[b, 1 : a + 1] = torch.randperm(T - 1, generator=gen)[:a].sort().values + 1
                path[b, a + 1 :] = path[b, a]
                keep[b, : a + 1] = True
            args = (layers, slots.to(device), path.to(device), keep.to(device))
            want, got = cache.clone(), cache.clone()
            commit_tree_kv_reference(want, *args)
            commit_tree_kv_triton(got, *args)
            ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
            entry = layers * dim * 2
            rec: dict[str, Any] = {
                "model": name, "batch": batch, "tree": T, "path": P, "ok": ok,
                "bytes": (int(keep.sum()) * 2 + batch * T) * entry,  # kept read + write, rest written
                "triton_graph_ms": graph_ms(partial(commit_tree_kv_triton, cache, *args)),
                "torch_graph_ms": graph_ms(partial(commit_tree_kv_reference, cache, *args)),
            }
            records.append(rec)
            log(f"tree commit {rec}")
            del cache, want, got
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--quick", action="store_true", help="smaller grid (smoke run)")
    parser.add_argument("--only", choices=["tree_commit"], help="run this part alone")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(args.out_dir / "gpu_kernels.log")
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 2
    import triton

    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": props.name,
           "sms": props.multi_processor_count}
    log(f"env: {env}")
    result: dict[str, Any] = {"env": env}
    if args.only is None:
        result["checks"] = run_checks(log)
        result["sweep"] = run_sweep(log, args.quick)
        result["attention"] = run_attention_grid(log, args.quick)
        result["compaction"] = run_compaction(log)
    result["tree_commit"] = run_tree_commit(log)
    failed = [c for c in result.get("checks", []) + result["tree_commit"] if not c["ok"]]
    result["ok"] = not failed
    result["wall_s"] = round(time.time() - t_start, 1)
    json_path = args.out_dir / "gpu_kernels.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    log(f"done in {result['wall_s']} s; {len(failed)} failed checks; wrote {json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
