"""The GPU's dense GEMV on repacked Q4_0 / Q8_0 rows (quant.repack), for the matrices every decode
step reads whole: the attention projections, the output head, the predictor (imported lazily:
triton is optional).

A program owns BR rows and walks their blocks NB at a time: each block's quants are QW aligned
32-bit words (Q4_0: 4, Q8_0: 8), one vector load per block and row; each word's four bytes are
turned into fp32 without a conversion instruction (the byte, or nibble, or-ed into the mantissa of
2^23, minus 2^23 and the offset: exact), multiplied with x at the byte's columns and summed per
block, then scaled by the block's f16 scale. Word j of a Q4_0 block holds columns 4j + i (low
nibbles, i = 0..3) and 16 + 4j + i (high); of a Q8_0 block columns 4j + i. Grid (T, row blocks):
the programs of one row block for the T tokens run side by side and share the rows through L2.

Dimension legend: T tokens, D columns (NBLK = D / 32 blocks), R rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import BLOCK_BYTES, QK, block_qtype

QT_CODE = {"q4_0r": 1, "q8_0r": 2}
BR, NB, WARPS = 8, 32, 4  # rows a program, blocks a step, warps a program
MAX_GRID_ROWS = 65535  # CUDA's limit on the grid's second axis


@triton.jit
def _qgemv_kernel(x_ptr, wq_ptr, wd_ptr, b_ptr, y_ptr, R, s_wq, s_wd, s_x, s_y,
                  NBLK: tl.constexpr, QT: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr,
                  NB: tl.constexpr):
    """y[t, r] = sum_b d[r, b] * sum_c q[r, b, c] * x[t, 32 b + c] (+ bias[r]) for BR rows."""
    QW: tl.constexpr = 4 * QT  # quant words a block
    t = tl.program_id(0).to(tl.int64)
    r1 = tl.program_id(1) * BR + tl.arange(0, BR)
    rows = r1.to(tl.int64)[:, None, None]  # [BR, 1, 1]
    rmask = rows < R
    j = tl.arange(0, QW)[None, None, :]  # [1, 1, QW]
    xrow = x_ptr + t * s_x
    # every operand of the loop is loaded at the tile's full shape [BR, NB, QW] (x and the scales
    # with repeated addresses): one layout throughout, no conversion through shared memory
    acc = tl.zeros((BR, NB, QW), dtype=tl.float32)
    for b0 in range(0, NBLK, NB):
        b = b0 + tl.arange(0, NB)[None, :, None]  # [1, NB, 1]
        m = rmask & (b < NBLK) & (j < QW)  # [BR, NB, QW]
        w = tl.load(wq_ptr + rows * s_wq + b * QW + j, mask=m, other=0)  # int32
        d = tl.load(wd_ptr + rows * s_wd + b + 0 * j, mask=m, other=0.0).to(tl.float32)
        xo = 32 * b + 4 * j + 0 * rows  # the column of each word's first byte
        s = tl.zeros((BR, NB, QW), dtype=tl.float32)
        for i in tl.static_range(4):
            if QT == 1:
                lo = (((w >> (8 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                hi = (((w >> (8 * i + 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                xl = tl.load(xrow + xo + i, mask=m, other=0.0).to(tl.float32)
                xh = tl.load(xrow + xo + (16 + i), mask=m, other=0.0).to(tl.float32)
                s += lo * xl + hi * xh
            else:
                v = ((((w >> (8 * i)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
                s += v * tl.load(xrow + xo + i, mask=m, other=0.0).to(tl.float32)
        acc += s * d
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BR]
    rows, rmask = r1.to(tl.int64), r1 < R
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * s_y + rows, y, mask=rmask)


def qgemv_triton(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None, *,
                 br: int = BR, nb: int = NB, warps: int = WARPS) -> torch.Tensor:
    """y [T, R] float32 = x [T, D] . dequantize(w, qtype)^T + bias, w uint8 [R, D / 32 * block
    bytes] repacked rows (qtype 'q4_0r' | 'q8_0r') with unit column stride and 4-byte aligned rows."""
    T, D = x.shape
    R = w.shape[0]
    bb, nblk = BLOCK_BYTES[block_qtype(qtype)], D // QK
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if R == 0 or T == 0:
        return y
    if w.stride(0) % 4 or w.storage_offset() % 4 or w.stride(1) != 1:
        raise ValueError(f"qgemv: rows of stride {w.stride()} at offset {w.storage_offset()}: expected 4-byte aligned rows")
    if triton.cdiv(R, br) > MAX_GRID_ROWS:
        raise ValueError(f"qgemv: {R} rows need more than {MAX_GRID_ROWS} programs of {br} rows: raise br")
    x = x.contiguous()
    wq = w.view(torch.int32)  # [R, row bytes / 4]
    wd = w.view(torch.float16)[:, nblk * (bb - 2) // 2:]  # the scales: after the quants
    dummy = y
    _qgemv_kernel[(T, triton.cdiv(R, br))](
        x, wq, wd, bias if bias is not None else dummy, y, R, wq.stride(0), wd.stride(0), x.stride(0), y.stride(0),
        NBLK=nblk, QT=QT_CODE[qtype], HAS_BIAS=bias is not None, BR=br, NB=nb, num_warps=warps)
    return y


@triton.jit
def _dequant_kernel(wq_ptr, wd_ptr, out_ptr, R, s_wq, s_wd, s_out,
                    NBLK: tl.constexpr, QT: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """out[r, 32 b + c] = d[r, b] * q[r, b, c] for BR rows and NB blocks (grid: rows, blocks)."""
    QW: tl.constexpr = 4 * QT
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)[:, None, None]  # [BR, 1, 1]
    b = tl.program_id(1) * NB + tl.arange(0, NB)[None, :, None]  # [1, NB, 1]
    j = tl.arange(0, QW)[None, None, :]  # [1, 1, QW]
    m = (rows < R) & (b < NBLK) & (j < QW)
    w = tl.load(wq_ptr + rows * s_wq + b * QW + j, mask=m, other=0)
    d = tl.load(wd_ptr + rows * s_wd + b + 0 * j, mask=m, other=0.0).to(tl.float32)
    o = out_ptr + rows * s_out + 32 * b + 4 * j
    for i in tl.static_range(4):
        if QT == 1:
            lo = (((w >> (8 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            hi = (((w >> (8 * i + 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            tl.store(o + i, (lo * d).to(out_ptr.dtype.element_ty), mask=m)
            tl.store(o + (16 + i), (hi * d).to(out_ptr.dtype.element_ty), mask=m)
        else:
            v = ((((w >> (8 * i)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            tl.store(o + i, (v * d).to(out_ptr.dtype.element_ty), mask=m)


def dequantize_triton(w: torch.Tensor, qtype: str, out: torch.Tensor) -> torch.Tensor:
    """out [R, D] (fp16 / bf16 / fp32, row-major) = the values of repacked rows w (qtype 'q4_0r' |
    'q8_0r'), each rounded once to out's dtype: `quant.dequantize` in one launch."""
    R = w.shape[0]
    bb, nblk = BLOCK_BYTES[block_qtype(qtype)], out.shape[1] // QK
    if R == 0:
        return out
    wq, wd = w.view(torch.int32), w.view(torch.float16)[:, nblk * (bb - 2) // 2:]
    grid = (triton.cdiv(R, BR), triton.cdiv(nblk, NB))
    _dequant_kernel[grid](wq, wd, out, R, wq.stride(0), wd.stride(0), out.stride(0),
                          NBLK=nblk, QT=QT_CODE[qtype], BR=BR, NB=NB, num_warps=WARPS)
    return out
