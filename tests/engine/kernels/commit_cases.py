"""Random verified trees for the fused tree KV commit (``engine.kernels.tree_commit``) against a
naive per-sequence replay and the PyTorch reference (``engine.kv.compaction``).

Shared by the unit tests (reference only), the interpreter checks (CPU) and the GPU tests. Each
sequence's tree sits at random slots of a shared cache (disjoint across sequences, not in slot
order); its accepted path goes down the tree in node order and repeats its last node past the
accepted count, as the acceptance kernels write it.
"""

from __future__ import annotations

import torch

LAYERS, EXTRA_LAYERS, BLOCKS, BLOCK_SIZE = 3, 1, 12, 8


def make_trees(gen: torch.Generator, B: int, T: int, P: int, device: str = "cpu"):  # type: ignore[no-untyped-def]
    """(tree_slots [B, T], path [B, P], keep [B, P]) for B random trees of T nodes."""
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[: B * T].view(B, T)
    path = torch.zeros(B, P, dtype=torch.long)
    keep = torch.zeros(B, P, dtype=torch.bool)
    for b in range(B):
        accepted = int(torch.randint(0, P, (1,), generator=gen))
        nodes = torch.randperm(T - 1, generator=gen)[:accepted].sort().values + 1  # [a] increasing
        path[b, 1 : accepted + 1] = nodes
        path[b, accepted + 1 :] = path[b, accepted]
        keep[b, : accepted + 1] = True
    return slots.to(device), path.to(device), keep.to(device)


def naive_commit(kv: torch.Tensor, num_layers: int, slots: torch.Tensor, path: torch.Tensor,
                 keep: torch.Tensor) -> torch.Tensor:
    """The commit written out per sequence: read the kept entries, then write the tree."""
    out = kv.clone()
    flat = out.view(out.shape[0], -1, out.shape[-1])[:num_layers]  # [L, slots, D]
    for b in range(slots.shape[0]):
        kept = [flat[:, int(slots[b, int(path[b, j])])].clone() if bool(keep[b, j]) else None
                for j in range(path.shape[1])]  # fmt: skip
        for i in range(slots.shape[1]):
            entry = kept[i] if i < len(kept) else None
            flat[:, int(slots[b, i])] = entry if entry is not None else 0
    return out


def check_tree_commit(device: str, *, triton: bool = True) -> tuple[float, float]:
    """0 when the commit (the Triton kernel, else the reference) is bit-exact with the naive
    replay on random trees in float32 and bfloat16, entry widths on and off the column tile."""
    from engine.kv.compaction import commit_tree_kv_reference

    gen = torch.Generator().manual_seed(5)
    bad = 0
    for dtype, B, T, P, D in [(torch.float32, 3, 9, 4, 20), (torch.bfloat16, 5, 17, 6, 64),
                              (torch.float32, 1, 33, 6, 40), (torch.bfloat16, 2, 2, 2, 32)]:
        shape = (LAYERS + EXTRA_LAYERS, BLOCKS, BLOCK_SIZE, D)  # [L_all, blocks, block_size, D]
        kv = torch.randn(shape, generator=gen).to(dtype).to(device)
        slots, path, keep = make_trees(gen, B, T, P, device)
        want = naive_commit(kv, LAYERS, slots, path, keep)
        got = kv.clone()
        if triton:
            from engine.kernels.tree_commit import commit_tree_kv_triton

            commit_tree_kv_triton(got, LAYERS, slots, path, keep)
        else:
            commit_tree_kv_reference(got, LAYERS, slots, path, keep)
        raw = torch.int32 if dtype == torch.float32 else torch.int16  # compare bit patterns
        bad += int(not torch.equal(got.view(raw), want.view(raw)))
    return float(bad), 0.0
