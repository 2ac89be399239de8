"""engine/host_tensor.py: int lists packed in C equal what torch.tensor builds."""

from __future__ import annotations

import pytest
import torch

from engine.host_tensor import int_tensor


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int_tensor_equals_torch_tensor(dtype: torch.dtype) -> None:
    values = [0, 1, -1, 2**31 - 1, -(2**31), 7] * 5
    got = int_tensor(values, dtype)
    assert got.dtype == dtype and got.shape == (len(values),)
    assert torch.equal(got, torch.tensor(values, dtype=dtype))


def test_int_tensor_of_nothing_and_of_large_ids() -> None:
    assert int_tensor([]).shape == (0,) and int_tensor([], torch.int32).dtype == torch.int32
    assert int_tensor([2**40]).item() == 2**40


def test_int_tensor_does_not_alias_the_list() -> None:
    values = [1, 2, 3]
    got = int_tensor(values)
    values[0] = 9
    assert got.tolist() == [1, 2, 3]


def test_int_tensor_rejects_what_does_not_fit() -> None:
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)


def test_int_tensor_keeps_its_memory_alive() -> None:
    """The tensor wraps the array's memory: it must hold the array, or the values would be
    overwritten once the array is collected and its memory reused."""
    import gc
    from array import array

    tensors = [int_tensor(list(range(i, i + 4096))) for i in range(16)]
    gc.collect()
    reuse = [array("q", [7] * 4096) for _ in range(64)]
    assert reuse and all(t.tolist() == list(range(i, i + 4096)) for i, t in enumerate(tensors))


def test_int_table_pads_each_row_to_the_width() -> None:
    from engine.host_tensor import int_table

    got = int_table([[1, 2], [], [3, 4, 5]], 3, -1)
    assert got.dtype == torch.int32
    assert got.tolist() == [[1, 2, -1], [-1, -1, -1], [3, 4, 5]]
    assert int_table([], 4, 0).shape == (0, 4)
