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
    """``host`` (a CPU tensor) copied to ``device`` without a stream synchronisation
    (``pinned``); ``host`` may be freed or changed right after. A no-op on the CPU."""
    device = torch.device(device)
    return pinned(host, device).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst.copy_(host)`` for a CPU tensor ``host``, without a stream synchronisation (``pinned``)."""
    dst.copy_(pinned(host, dst.device), non_blocking=True)


def pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` in page-locked memory if it goes to a CUDA ``device``, else itself.

    A blocking copy from pageable memory waits for all work queued on the device (the H200's
    autoregressive step had made eight such waits), and so, in part, does an asynchronous one:
    on the H200 a copy of 128 ints from pageable memory took 56 us of host time, 219 us behind
    ~1 ms of queued device work, against 8 and 34 us from pinned memory
    (``scripts/linear_shape_probe.py``): a graphed step whose batch had changed made five such
    copies. PyTorch's host allocator keeps the pinned block until the copy from it is done."""
    return host.pin_memory() if device.type == "cuda" else host


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
