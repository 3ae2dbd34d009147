"""The dense GEMV of quantized weights on the GPU (attention projections, the output head, the
predictor's fc1 / fc2), imported lazily: triton is optional.

One token (decode): ``_qgemv_kernel``, a program per BR rows, walking each row's ggml blocks NB at
a time. It reads a block as its f16 scale word and 8 (Q4_0) or 16 (Q8_0) 16-bit words of quants
(block rows are 2-byte aligned only: 18 or 34 bytes a block) and multiplies each word's 4 (2)
values with the x entries of their columns, loaded in the words' shape, so the values never
change layout in registers; the block's sum takes its scale once. fp32 sums, one reduction per
row at the end.
More tokens: the sparse FFN's up stage over every row with activation none (tl.dot over tokens
padded to 16, blocks of MAX_T tokens).

Dimension legend: T tokens, D columns of W, R rows of W.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_ffn import MAX_T, config_for
from .triton_stages import QT_CODE, launch_up, w_arg

_ROWS: dict[tuple[str, int], torch.Tensor] = {}
GEMV_BR, GEMV_NB, GEMV_WARPS = 4, 32, 4  # rows a program, blocks a step, warps a program


def _all_rows(R: int, device: torch.device) -> torch.Tensor:
    """int32 [R] = 0 .. R-1 on device (the up stage's idx: every row), cached."""
    key = (str(device), R)
    if key not in _ROWS:
        _ROWS[key] = torch.arange(R, dtype=torch.int32, device=device)
    return _ROWS[key]


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, R, D, s_w,
                  HAS_BIAS: tl.constexpr, QT: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """y [R] fp32 = x [D] . dequantize(w)^T (+ bias) for BR rows; w as int16 words (``w_arg``)."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)  # [BR]
    rmask = rows < R
    WB: tl.constexpr = 8 * QT  # words of quants per block (Q4_0: 8, Q8_0: 16), after the scale word
    j = tl.arange(0, WB)  # [WB]
    nblk = D // 32
    base = w_ptr + rows.to(tl.int64)[:, None] * s_w  # [BR, 1]
    acc = tl.zeros((BR, NB), dtype=tl.float32)
    for b0 in range(0, nblk, NB):
        b = b0 + tl.arange(0, NB)  # [NB]
        bok = b < nblk
        bm = rmask[:, None] & bok[None, :]  # [BR, NB]
        blk = base + (b * (WB + 1))[None, :]  # [BR, NB] scale words
        d = tl.load(blk, mask=bm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        v = tl.load(blk[:, :, None] + 1 + j[None, None, :], mask=bm[:, :, None], other=0).to(tl.int32) & 0xFFFF
        c = (b * 32)[:, None] + 2 * j[None, :]  # [NB, WB]: the column of each word's first value
        cm = bok[:, None]
        x0 = tl.load(x_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :, :]
        x1 = tl.load(x_ptr + c + 1, mask=cm, other=0.0).to(tl.float32)[None, :, :]
        if QT == 1:  # word j: bytes 2j, 2j + 1 = columns 2j, 2j + 16 and 2j + 1, 2j + 17 (low, high nibbles)
            x2 = tl.load(x_ptr + c + 16, mask=cm, other=0.0).to(tl.float32)[None, :, :]
            x3 = tl.load(x_ptr + c + 17, mask=cm, other=0.0).to(tl.float32)[None, :, :]
            s = ((v & 15) - 8).to(tl.float32) * x0 + (((v >> 8) & 15) - 8).to(tl.float32) * x1 \
                + (((v >> 4) & 15) - 8).to(tl.float32) * x2 + ((v >> 12) - 8).to(tl.float32) * x3
        else:  # word j: columns 2j, 2j + 1 (int8 each)
            s = (((v & 255) ^ 128) - 128).to(tl.float32) * x0 + ((((v >> 8) & 255) ^ 128) - 128).to(tl.float32) * x1
        acc += d * tl.sum(s, axis=2)
    y = tl.sum(acc, axis=1)  # [BR]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y, mask=rmask)


def qgemv(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None, y: torch.Tensor,
          tiles: tuple[int, int, int] = (GEMV_BR, GEMV_NB, GEMV_WARPS)) -> None:
    """y [R] fp32 from one token x [D] (``_qgemv_kernel``; tiles: BR, NB, warps)."""
    R, D = w.shape[0], x.shape[-1]
    ww, s_w = w_arg(w, qtype)
    br, nb, warps = tiles
    _qgemv_kernel[(triton.cdiv(R, br),)](
        x, ww, bias if bias is not None else y, y, R, D, s_w, HAS_BIAS=bias is not None, QT=QT_CODE[qtype],
        BR=br, NB=nb, num_warps=warps)


def linear_triton(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, R] float32 = x [T, D] . dequantize(w)^T + bias: w uint8 [R, D // 32 * block bytes] of
    qtype, dequantized in registers; bias [R] or None. One token: the GEMV kernel; more: blocks of
    MAX_T tokens through the up stage."""
    T, _ = x.shape
    R = w.shape[0]
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if R == 0 or T == 0:
        return y
    x = x.contiguous()
    rows = _all_rows(R, x.device)
    if T == 1 and not os.environ.get("POWERINFER_RAY_AB_UPSTAGE_GEMV"):  # A/B switch: deleted once measured
        qgemv(x, w, qtype, bias, y)
        return y
    for t0 in range(0, T, MAX_T):
        t1 = min(T, t0 + MAX_T)
        launch_up(x[t0:t1], w, None, bias, rows, None, None, "none", y[t0:t1], config_for(t1 - t0), qtype)
    return y
