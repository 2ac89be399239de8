"""Host cost of loading an autoregressive step's inputs into the captured step (a diagnosis tool).

Times ``_Static.load_decode`` (``engine/cuda_graphs.py``) for a steady batch whose sequences
each gain a token per step, at a few context lengths: as the engine runs it (only the block-table
rows that changed are written) and, with the table cache cleared before every load, with every
row rebuilt (what each step did before). CPU tensors unless ``--device cuda``.

    PYTHONPATH=. python scripts/decode_load_cost.py [--batch 256] [--contexts 64,1000]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.cuda_graphs import _Static


def _time_loads(batch: int, context: int, block_size: int, device: torch.device, rewrite_all: bool,
                steps: int = 200) -> float:
    """Microseconds per ``load_decode`` over ``steps`` steps of a steady batch."""
    max_blocks = -(-(context + steps + 16) // block_size) + 1
    st = _Static(batch, 1, max_blocks, [0, 1], block_size, 64, torch.float32, device)
    blocks = [list(range(2 + i * max_blocks, 2 + (i + 1) * max_blocks)) for i in range(batch)]
    tokens = [1] * batch
    start = [context + i % block_size for i in range(batch)]  # rows cross blocks at different steps
    elapsed = 0.0
    for k in range(steps + 1):
        positions = [p + k for p in start]
        widths = [p // block_size + 1 for p in positions]
        if rewrite_all:
            st._table_lists, st._table_widths = [], []
        t0 = time.perf_counter()
        st.load_decode(tokens, blocks, widths, positions, block_size)
        if k:  # the first load writes every row either way
            elapsed += time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", default="64,1000")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    for context in (int(c) for c in args.contexts.split(",")):
        changed = _time_loads(args.batch, context, args.block_size, device, rewrite_all=False)
        every = _time_loads(args.batch, context, args.block_size, device, rewrite_all=True)
        print(f"batch {args.batch}, context {context}: {changed:.0f} us per load (changed rows), "
              f"{every:.0f} us (every row)")


if __name__ == "__main__":
    main()
