"""Host tensors from Python lists of ints, packed in C, and their copy to the device.

``torch.tensor`` converts a list element by element (~80 ns each on a 2-core CPU: 0.7 ms for the
block tables of 64 sequences, 8k entries, built at every prefill chunk and MTP catch-up);
``array`` packs the same list in one C loop and ``torch.frombuffer`` wraps its memory, about 3x
faster. The tensor keeps the array alive.
"""

from __future__ import annotations

from array import array

import torch

_TYPECODES = {torch.int32: "i", torch.int64: "q"}
assert array("i").itemsize == 4 and array("q").itemsize == 8


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) copied to ``device`` without a stream synchronisation.

    A blocking copy from pageable memory waits for all work queued on the device (the H200's
    autoregressive step had made eight such waits). CUDA stages pageable bytes before the
    asynchronous call returns, so ``host`` may be freed or changed right after, as with a
    blocking copy. A no-op on the CPU."""
    return host.to(device, non_blocking=True)


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a 1-D CPU tensor of ``dtype`` (torch.int32 or torch.int64)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


def int_table(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    """``rows`` (each at most ``width`` long) padded with ``fill`` into a ``[len(rows), width]``
    int32 CPU tensor: block tables, in one packed copy."""
    flat: list[int] = []
    for row in rows:
        flat += row
        flat += [fill] * (width - len(row))
    return int_tensor(flat, torch.int32).view(len(rows), width)
