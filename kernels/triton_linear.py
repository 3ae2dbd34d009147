"""The dense GEMV of quantized weights on the GPU (attention projections, the output head, the
predictor's fc1 / fc2) on the file's ggml blocks (imported lazily: triton is optional).

Up to TOKENS_MAX tokens every token runs the T == 1 GEMV (`_tokens_kernel`: the sparse FFN's row
dots, elementwise multiply-adds in fp32), one program per (row block, token), the T programs of a
row block next to each other in the grid so that its rows come from memory once and from L2 for
the others; a token's result is the one it gets alone. More tokens: the sparse FFN's up stage over
every row (tl.dot over all tokens at once, tf32x3), in blocks of MAX_T tokens.

Dimension legend: T tokens, D columns of W, R rows of W.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ffn import CONFIGS, MAX_T, config_for
from .triton_stages import QT_CODE, _rows_dot_x, launch_up, tile_width, w_arg

# Tokens the per-token GEMV takes; more: the tl.dot up stage. The per-token kernel's time grows with T,
# the tl.dot stage's hardly: on an H100 at the 13B's Q8_0 shapes they cross between 16 and 32 tokens
# (bench kernels --gpu-dtypes q8_0: kernels-linear-tokens-h100-a93fea1.json).
TOKENS_MAX = 16

_ROWS: dict[tuple[str, int], torch.Tensor] = {}


def _all_rows(R: int, device: torch.device) -> torch.Tensor:
    """int32 [R] = 0 .. R-1 on device (the up stage's idx: every row), cached."""
    key = (str(device), R)
    if key not in _ROWS:
        _ROWS[key] = torch.arange(R, dtype=torch.int32, device=device)
    return _ROWS[key]


@triton.jit
def _tokens_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, R, D, s_w, s_x, s_y,
                   HAS_BIAS: tl.constexpr, RELU: tl.constexpr, QT: tl.constexpr, BK: tl.constexpr,
                   BD: tl.constexpr):
    """y[t, r] = w[r] . x[t] (+ bias[r], then max(., 0) with RELU) for the BK rows of block pid // T
    and the token pid % T."""
    pid = tl.program_id(0)
    t = (pid % T).to(tl.int64)
    offs = (pid // T) * BK + tl.arange(0, BK)
    rmask = offs < R
    rows = offs.to(tl.int64)
    u, _ = _rows_dot_x(x_ptr + t * s_x, w_ptr, w_ptr, rows, rmask, D, s_w, s_w, False, QT, BK, BD)
    if HAS_BIAS:
        u += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if RELU:
        u = tl.maximum(u, 0.0)
    tl.store(y_ptr + t * s_y + rows, u, mask=rmask)


def linear_triton(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                  relu: bool = False) -> torch.Tensor:
    """y [T, R] float32 = x [T, D] . dequantize(w)^T + bias (then max(y, 0) with ``relu``, in the same
    kernel): w uint8 [R, D // 32 * block bytes] of qtype, dequantized in registers; bias [R] or None."""
    T, _ = x.shape
    R = w.shape[0]
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if R == 0 or T == 0:
        return y
    x = x.contiguous()
    if T > TOKENS_MAX:
        return linear_up_stage(x, w, qtype, bias, relu, y)
    cfg = CONFIGS["qgemv"]
    wq, s_w = w_arg(w, qtype)
    _tokens_kernel[(T * triton.cdiv(R, cfg.up_bk),)](
        x, wq, bias if bias is not None else y, y, T, R, x.shape[1], s_w, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, RELU=relu, QT=QT_CODE[qtype], BK=cfg.up_bk, BD=tile_width(cfg.up_bd, qtype),
        num_warps=cfg.up_warps, num_stages=cfg.up_stages)
    return y


def linear_up_stage(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None, relu: bool,
                y: torch.Tensor) -> torch.Tensor:
    """`linear_triton` through the sparse FFN's up stage over every row, MAX_T tokens a launch."""
    rows = _all_rows(w.shape[0], x.device)
    for t0 in range(0, x.shape[0], MAX_T):
        t1 = min(x.shape[0], t0 + MAX_T)
        launch_up(x[t0:t1], w, None, bias, rows, None, None, "relu" if relu else "none", y[t0:t1],
                  config_for(t1 - t0), qtype)
    return y
