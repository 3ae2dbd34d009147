"""staging: rows of a memory map to a device in chunks through two buffers, against index_select."""
from __future__ import annotations

import pytest
import torch

from powerinfer_ray.model.staging import _Stager, copy_rows


@pytest.mark.parametrize("shape", [(50, 24), (50,)])
def test_chunked_copy_equals_the_rows(shape):
    """Buffers of 3 rows (and 3 bytes short of 4): every chunk, the last one partial, in both
    buffers in turn; all rows, a gather in any order (repeats too), none."""
    g = torch.Generator().manual_seed(0)
    view = torch.randn(shape, generator=g).half()
    row = view[0].numel() * view.element_size()
    for nbytes in (3 * row, 4 * row - 3):
        st = _Stager(torch.device("cpu"), nbytes)
        for ids in (None, torch.tensor([7, 3, 3, 49, 0, 12, 11, 40, 2, 5, 6]), torch.tensor([], dtype=torch.long)):
            want = view if ids is None else view[ids]
            got = st.copy(view, ids)
            assert got.dtype == view.dtype and torch.equal(got, want)
            assert got.data_ptr() != view.data_ptr()


def test_copy_rows_on_the_cpu_is_a_copy():
    view = torch.arange(40, dtype=torch.float16).reshape(10, 4)
    ids = torch.tensor([9, 0, 4])
    assert torch.equal(copy_rows(view, ids, "cpu"), view[ids])
    got = copy_rows(view, None, "cpu")
    assert torch.equal(got, view) and got.data_ptr() != view.data_ptr()
