"""One MTP module's forward over M rows, the layer path against the drafting layer
(``engine/model/draft_layer.py``), each captured in a CUDA graph and timed on the GPU.

Random weights of a training preset's shape in bfloat16; ``M / rows`` sequences of ``rows`` new
rows each (a causal mask among them) over ``--context`` committed entries. Prints and writes
``OUT/draft_layer_bench.json``: microseconds per forward of both paths at each M, and the
largest relative difference of their outputs::

    PYTHONPATH=. python scripts/draft_layer_bench.py OUT --preset gpu
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from bench.gpu_kernels import graph_ms
from engine.model.attention_batch import AttentionBatch
from engine.model.draft_layer import DraftLayer
from scripts.random_weights import random_model


def batch_of(M: int, rows: int, context: int, block_size: int, device: torch.device) -> AttentionBatch:
    """``M // rows`` sequences of ``rows`` new rows after ``context`` committed entries each."""
    seqs = M // rows
    blocks = -(-(context + rows) // block_size)
    tables = torch.arange(seqs * blocks, dtype=torch.int32, device=device).view(seqs, blocks)
    offsets = torch.arange(rows, device=device)
    positions = (context + offsets).repeat(seqs)  # [M]
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).view(seqs, -1)
    return AttentionBatch(
        positions=positions,
        slot_mapping=slots[:, context : context + rows].reshape(-1),
        block_tables=tables,
        ctx_lens=torch.full((seqs,), context, dtype=torch.int32, device=device),
        query_start=torch.arange(seqs + 1, dtype=torch.int32, device=device) * rows,
        new_mask=(offsets[:, None] >= offsets[None, :]).repeat(seqs, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--rows", type=int, default=8, help="new rows per sequence")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--sizes", default="8,16,32,64,128,256,512,1024", help="M: rows per forward")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = random_model(args.preset, device)
    cfg = model.config
    model.fuse_projections()
    layer = model.mtp_layer(1)
    draft = DraftLayer(layer)
    block_size = 16
    records = []
    with torch.inference_mode():
        for M in (int(m) for m in args.sizes.split(",")):
            batch = batch_of(M, args.rows, args.context, block_size, device)
            seqs = M // args.rows
            blocks = batch.block_tables.numel()
            cache = torch.randn(cfg.num_hidden_layers + cfg.num_mtp_modules, blocks, block_size,
                                cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=device, dtype=torch.bfloat16)  # fmt: skip
            x = torch.randn(seqs * args.rows, cfg.hidden_size, device=device, dtype=torch.bfloat16)
            layer_cache = cache[model.mtp_cache_layer(1)]
            want = model.forward_mtp_fused(1, x, batch, cache)
            got = draft.forward(x.clone(), model.rope, batch, layer_cache)  # (updates its input)
            diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            layer_path = partial(model.forward_mtp_fused, 1, x, batch, cache)
            drafting = partial(draft.forward, x, model.rope, batch, layer_cache)
            rec = {"rows": seqs * args.rows, "layer_us": round(graph_ms(layer_path, calls=20) * 1e3, 2),
                   "draft_us": round(graph_ms(drafting, calls=20) * 1e3, 2), "max_rel_diff": round(diff, 5)}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_layer_bench.json").write_text(json.dumps(
        {"preset": args.preset, "rows_per_sequence": args.rows, "context": args.context,
         "device": torch.cuda.get_device_name(), "records": records}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
