"""The GPU's dense GEMV on repacked Q4_0 rows (quant.repack), for the matrices every decode step
reads whole: the attention projections, the output head, the predictor (imported lazily: triton
is optional).

A program owns BR rows and walks their blocks NB at a time, in tiles [BR, NB * 4 words, 4 bytes]
with the bytes innermost: a word's bytes come in one 32-bit load, and byte i of word j holds
columns 4j + i (low nibble) and 16 + 4j + i (high), so the x values of a word's low (high) nibbles
are 4 adjacent columns, one 64-bit load of fp16. Each nibble becomes fp32 without a conversion
instruction (or-ed into the mantissa of 2^23, minus 2^23 + 8: exact), is multiplied with x at its
column, scaled by the block's f16 scale and summed. Grid (T, row blocks): the programs of one row
block for the T tokens run side by side and share the rows through L2.

Dimension legend: T tokens, D columns (NBLK = D / 32 blocks), R rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import BLOCK_BYTES, QK

QW = 4  # 32-bit words of quants a block
BR, NB, WARPS = 8, 16, 8  # rows a program, blocks a step, warps a program (the H100's best at 5120 x 5120)
MAX_GRID_ROWS = 65535  # CUDA's limit on the grid's second axis


@triton.jit
def _qgemv_kernel(x_ptr, wq_ptr, wd_ptr, b_ptr, y_ptr, R, s_wq, s_wd, s_x, s_y,
                  NBLK: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
                  QW: tl.constexpr):
    """y[t, r] = sum_b d[r, b] * sum_c (q[r, b, c] - 8) * x[t, 32 b + c] (+ bias[r]) for BR rows."""
    t = tl.program_id(0).to(tl.int64)
    r1 = tl.program_id(1) * BR + tl.arange(0, BR)
    rows = r1.to(tl.int64)[:, None, None]  # [BR, 1, 1]
    rmask = rows < R
    wi = tl.arange(0, NB * QW)[None, :, None]  # [1, NB QW, 1]: the step's words
    i = tl.arange(0, 4)[None, None, :]  # [1, 1, 4]: a word's bytes
    xrow = x_ptr + t * s_x
    # every operand is loaded at the tile's full shape [BR, NB QW, 4] (x and the scales with repeated
    # addresses) with the bytes innermost: one layout throughout, no conversion through shared memory,
    # the quants in 32-bit loads and x's 4 columns a byte's nibbles take in 64-bit ones
    acc = tl.zeros((BR, NB * QW, 4), dtype=tl.float32)
    for b0 in range(0, NBLK, NB):
        blk = b0 + wi // QW  # [1, NB QW, 1]
        bm = rmask & (blk < NBLK)  # [BR, NB QW, 1]
        m = bm & (i < 4)  # [BR, NB QW, 4]
        q = tl.load(wq_ptr + rows * s_wq + (b0 * QW + wi) * 4 + i, mask=m, other=0).to(tl.int32)
        d = tl.load(wd_ptr + rows * s_wd + blk, mask=bm, other=0.0).to(tl.float32)  # [BR, NB QW, 1]
        col = 32 * blk + 4 * (wi % QW) + i + 0 * rows  # byte i of word j: columns 4j + i (low), 16 + 4j + i (high)
        xl = tl.load(xrow + col, mask=m, other=0.0).to(tl.float32)
        xh = tl.load(xrow + col + 16, mask=m, other=0.0).to(tl.float32)
        lo = ((q & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # exact: 2^23 + n - (2^23 + 8)
        hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        acc += (lo * xl + hi * xh) * d
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BR]
    rows, rmask = r1.to(tl.int64), r1 < R
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * s_y + rows, y, mask=rmask)


def qgemv_triton(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None, *,
                 br: int = BR, nb: int = NB, warps: int = WARPS) -> torch.Tensor:
    """y [T, R] float32 = x [T, D] . dequantize(w, qtype)^T + bias, w uint8 [R, D / 32 * 18]
    repacked Q4_0 rows (qtype 'q4_0r') with unit column stride and 4-byte aligned rows."""
    T, D = x.shape
    R = w.shape[0]
    assert qtype == "q4_0r", qtype
    bb, nblk = BLOCK_BYTES["q4_0"], D // QK
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if R == 0 or T == 0:
        return y
    if w.stride(0) % 4 or w.storage_offset() % 4 or w.stride(1) != 1:
        raise ValueError(f"qgemv: rows of stride {w.stride()} at offset {w.storage_offset()}: expected 4-byte aligned rows")
    if triton.cdiv(R, br) > MAX_GRID_ROWS:
        raise ValueError(f"qgemv: {R} rows need more than {MAX_GRID_ROWS} programs of {br} rows: raise br")
    x = x.contiguous()
    wq = w  # [R, row bytes]
    wd = w.view(torch.float16)[:, nblk * (bb - 2) // 2:]  # the scales: after the quants
    dummy = y
    _qgemv_kernel[(T, triton.cdiv(R, br))](
        x, wq, wd, bias if bias is not None else dummy, y, R, wq.stride(0), wd.stride(0), x.stride(0), y.stride(0),
        NBLK=nblk, HAS_BIAS=bias is not None, BR=br, NB=nb, QW=QW, num_warps=warps)
    return y

