"""The dense GEMV of quantized weights on the GPU (attention projections, the output head, the
predictor's fc1 / fc2): the sparse FFN's up stage over every row, activation none (imported
lazily: triton is optional).

Dimension legend: T tokens, D columns of W, R rows of W.
"""
from __future__ import annotations

import torch

from .triton_ffn import MAX_T, config_for
from .triton_stages import launch_up

_ROWS: dict[tuple[str, int], torch.Tensor] = {}


def _all_rows(R: int, device: torch.device) -> torch.Tensor:
    """int32 [R] = 0 .. R-1 on device (the up stage's idx: every row), cached."""
    key = (str(device), R)
    if key not in _ROWS:
        _ROWS[key] = torch.arange(R, dtype=torch.int32, device=device)
    return _ROWS[key]


def linear_triton(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                  relu: bool = False) -> torch.Tensor:
    """y [T, R] float32 = x [T, D] . dequantize(w)^T + bias (then max(y, 0) with ``relu``, in the same
    kernel): w uint8 [R, D // 32 * block bytes] of qtype, dequantized in registers; bias [R] or None.
    Blocks of MAX_T tokens."""
    T, _ = x.shape
    R = w.shape[0]
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if R == 0 or T == 0:
        return y
    rows = _all_rows(R, x.device)
    x = x.contiguous()
    for t0 in range(0, T, MAX_T):
        t1 = min(T, t0 + MAX_T)
        cfg = config_for(t1 - t0)
        launch_up(x[t0:t1], w, None, bias, rows, None, None, "relu" if relu else "none", y[t0:t1], cfg, qtype)
    return y
