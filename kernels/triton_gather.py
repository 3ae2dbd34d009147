"""Rows gathered by index into a device buffer, as wide loads in flight at once: how prefill streams
the CPU shard's rows out of page-locked host memory over PCIe (runtime/cold.py; imported lazily:
triton is optional).

Grid (rows, pieces of a row): a program copies BW 32-bit words of one row, so every piece of every
row is an independent read and thousands of them are in flight together (torch's index_select
walks the words of the output with dependent index math and far fewer reads outstanding).

Dimension legend: R rows gathered, W 32-bit words a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BW, WARPS = 1024, 4  # words a program, warps a program


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, dst_ptr, W, s_src, s_dst, BW: tl.constexpr):
    r = tl.program_id(0)
    w = tl.program_id(1) * BW + tl.arange(0, BW)
    row = tl.load(idx_ptr + r).to(tl.int64)
    v = tl.load(src_ptr + row * s_src + w, mask=w < W)
    tl.store(dst_ptr + r.to(tl.int64) * s_dst + w, v, mask=w < W)


def gatherable(src: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `gather_rows` takes these row-major matrices: rows of whole, aligned 32-bit words."""
    return all(t.dim() == 2 and t.stride(1) == 1 and t.shape[1] * t.element_size() % 4 == 0
               and t.stride(0) * t.element_size() % 4 == 0 and t.data_ptr() % 4 == 0 for t in (src, out))


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[idx[i]] for i < len(idx) (out [>= len(idx), c] of src's row width and dtype; src
    may be a device view of page-locked host memory): ``torch.index_select(src, 0, idx, out=...)``."""
    R = idx.shape[0]
    assert gatherable(src, out) and src.shape[1] * src.element_size() == out.shape[1] * out.element_size(), \
        (tuple(src.shape), tuple(out.shape))
    if R == 0:
        return out
    s, o = src.view(torch.int32), out.view(torch.int32)
    W = s.shape[1]
    _gather_rows_kernel[(R, triton.cdiv(W, BW))](s, idx, o, W, s.stride(0), o.stride(0), BW=BW, num_warps=WARPS)
    return out
