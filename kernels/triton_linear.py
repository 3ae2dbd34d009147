"""The dense GEMV of quantized weights on the GPU (attention projections, the output head, the
predictor's fc1 / fc2), imported lazily: triton is optional.

One token (decode): ``_qgemv_kernel``, a program per BR rows, each row's ggml blocks NB at a time
(``triton_stages.q_rows_dot``, which the sparse FFN's up stage runs on quantized rows too: block
rows are 2-byte aligned only, 18 or 34 bytes a block, and are read as 16-bit words).
More tokens: the sparse FFN's up stage over every row with activation none (tl.dot over tokens
padded to 16, blocks of MAX_T tokens).

Dimension legend: T tokens, D columns of W, R rows of W.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ffn import MAX_T, config_for
from . import triton_stages
from .triton_stages import QT_CODE, launch_up, q_rows_dot, w_arg

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
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    rmask = rows < R
    y = q_rows_dot(x_ptr, w_ptr, rows, rmask, D, s_w, QT, BR, NB)
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
    if T == 1 and not triton_stages.AB_OLD_Q:  # A/B switch: deleted once measured
        qgemv(x, w, qtype, bias, y)
        return y
    for t0 in range(0, T, MAX_T):
        t1 = min(T, t0 + MAX_T)
        launch_up(x[t0:t1], w, None, bias, rows, None, None, "none", y[t0:t1], config_for(t1 - t0), qtype)
    return y
