"""Tile configurations of ``fused_linear`` (engine/kernels/fused_linear.py) at the drafting
layer's GEMM shapes, against cuBLAS (``F.linear``) on the same shapes, each in a CUDA graph.

Prints and writes ``OUT/fused_linear_tune.json``: per (GEMM, rows) cuBLAS's microseconds, the
default tile's, and the fastest configurations::

    PYTHONPATH=. python scripts/fused_linear_tune.py OUT --preset gpu
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_layer_bench import graph_us  # noqa: E402

from engine.kernels.fused_linear import fused_linear  # noqa: E402


def shapes(preset: str) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """name -> (N, K, norm, residual, gated) of the drafting layer's GEMMs."""
    from train.presets import PRESETS

    p = PRESETS[preset]
    rank, rope, heads = p.kv_lora_rank, p.qk_rope_head_dim, p.num_attention_heads
    lora = p.q_lora_rank or p.hidden_size
    return {
        "qkv_a": (lora + rank + rope, p.hidden_size, True, False, False),
        "q": (heads * (rank + rope), lora, True, False, False),
        "o": (p.hidden_size, heads * rank, False, True, False),
        "gate_up": (p.intermediate_size, p.hidden_size, True, False, True),
        "down": (p.hidden_size, p.intermediate_size, False, True, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--rows", default="8,40")
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    configs = [dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
               for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4,), (2, 3, 4))]  # fmt: skip
    records = []
    for (name, (N, K, norm, res, gated)), M in itertools.product(shapes(args.preset).items(),
                                                                 (int(r) for r in args.rows.split(","))):  # fmt: skip
        x = torch.randn(M, K, device=dev, dtype=dt)
        w = torch.randn(2 * N if gated else N, K, device=dev, dtype=dt) / K**0.5
        eps = 1e-6 if norm else None
        r = torch.randn(M, N, device=dev, dtype=dt) if res else None
        want = fused_linear(x, w, eps, r, gated).float()
        rec: dict = {"gemm": name, "rows": M, "N": N, "K": K,
                     "cublas_us": round(graph_us(partial(F.linear, x, w)), 2),
                     "default_us": round(graph_us(partial(fused_linear, x, w, eps, r, gated)), 2)}  # fmt: skip
        timed = []
        for cfg in configs:
            try:
                got = fused_linear(x, w, eps, r, gated, **cfg).float()
                if not torch.allclose(got, want, rtol=3e-2, atol=3e-2):
                    continue
                timed.append((graph_us(partial(fused_linear, x, w, eps, r, gated, **cfg), calls=10, replays=10), cfg))
            except Exception:  # noqa: BLE001 - e.g. out of shared memory
                continue
        timed.sort(key=lambda t: t[0])
        rec["best"] = [{"us": round(t, 2), **c} for t, c in timed[:5]]
        records.append(rec)
        print(json.dumps(rec), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_linear_tune.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
