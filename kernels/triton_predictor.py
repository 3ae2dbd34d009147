"""The predictor's first layer for one token in one launch: z = relu(fc1 . x) with x the residual h
cast to the model's dtype inside the kernel (imported lazily: triton is optional).

Torch runs the same as four kernels in the decode step's segment (the cast of h, cuBLAS's split-K
GEMV and its reduction, the ReLU); here a program owns BR rows of fc1 and reads them whole: D is a
compile-time constant and the column steps of BK are unrolled, so every load of the program is in
flight before the first multiply. x is read at the tile's shape (every program from L2, every row
of it from L1). The second layer (fc2, [N, r]) stays a cuBLAS GEMV.

Dimension legend: D hidden, R rows of fc1 (the predictor's rank).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BR, BK, WARPS = 1, 1024, 4  # rows a program, columns a step, warps a program (bench/predictor_bench.py)

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _hidden_kernel(h_ptr, w_ptr, z_ptr, R, s_w, D: tl.constexpr, XDT: tl.constexpr, BR: tl.constexpr,
                   BK: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    rmask = r < R
    acc = tl.zeros((BR, BK), dtype=tl.float32)
    for k0 in tl.static_range(0, D, BK):
        k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
        m = rmask[:, None] & (k < D)  # [BR, BK]
        # x at the tile's full shape (each row's copy from L1): one layout, no conversion through shared memory
        x = tl.load(h_ptr + k + 0 * r[:, None], mask=m, other=0.0).to(XDT).to(tl.float32)  # the model dtype's rounding
        w = tl.load(w_ptr + r.to(tl.int64)[:, None] * s_w + k, mask=m, other=0.0).to(tl.float32)
        acc += w * x
    z = tl.maximum(tl.sum(acc, axis=1), 0.0)
    tl.store(z_ptr + r, z.to(z_ptr.dtype.element_ty), mask=rmask)


def predictor_hidden(h: torch.Tensor, fc1: torch.Tensor, dtype: torch.dtype, br: int = BR, bk: int = BK,
                     warps: int = WARPS) -> torch.Tensor:
    """relu(fc1 . h.to(dtype)) [1, R] in dtype, for h [1, D] (any float dtype) and fc1 [R, D] float
    rows with unit column stride: ``torch.relu(h.to(dtype) @ fc1.to(dtype).T)`` up to the order of
    the fp32 sums."""
    assert h.dim() == 2 and h.shape[0] == 1 and h.is_contiguous(), tuple(h.shape)
    assert fc1.dim() == 2 and fc1.shape[1] == h.shape[1] and fc1.stride(1) == 1, (tuple(fc1.shape), fc1.stride())
    R, D = fc1.shape
    z = torch.empty(1, R, dtype=dtype, device=h.device)
    _hidden_kernel[(triton.cdiv(R, br),)](h, fc1, z, R, fc1.stride(0), D=D, XDT=_TL[dtype], BR=br, BK=bk,
                                         num_warps=warps)
    return z
