"""Tests for melfeed.producer.batch_rows.RowBytes: where a row's bytes are, and its padding tail zeroed."""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.producer.batch_rows import RowBytes, zero_bytes


def test_head_is_the_rows_first_elements_and_zero_tail_clears_only_the_rest_of_that_row() -> None:
    arr = np.full((3, 5, 2), 7, dtype=np.int16)
    rows = RowBytes(arr, zero_bytes(64))
    assert (rows.row_nbytes, rows.capacity, rows.item_nbytes) == (20, 5, 4)
    rows.head(1, 2)[:] = np.arange(4, dtype=np.int16).tobytes()
    rows.zero_tail(1, 2)
    assert arr[1].tolist() == [[0, 1], [2, 3], [0, 0], [0, 0], [0, 0]]
    assert (arr[[0, 2]] == 7).all()  # neighbours untouched
    rows.zero_tail(2, 5)  # a full row has no tail
    assert (arr[2] == 7).all()


def test_a_rank_one_array_is_one_element_per_row() -> None:
    arr = np.arange(4, dtype=np.float32)
    rows = RowBytes(arr, zero_bytes(4))
    assert (rows.row_nbytes, rows.capacity, rows.item_nbytes) == (4, 1, 4)
    assert bytes(rows.head(2, 1)) == arr[2:3].tobytes()


def test_refuses_what_it_cannot_write_through() -> None:
    with pytest.raises(ValueError, match="C-contiguous"):
        RowBytes(np.zeros((4, 3), np.float32).T, zero_bytes(64))
    readonly = np.zeros((2, 3), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        RowBytes(readonly, zero_bytes(64))
    with pytest.raises(ValueError, match="shorter than a row"):
        RowBytes(np.zeros((2, 3), np.float32), zero_bytes(8))
