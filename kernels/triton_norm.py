"""Triton kernel of `norm.rms_norm_cast`: a row's RMS norm and the cast to the compute dtype in one
launch (imported lazily: triton is optional).

Dimension legend: N rows, D hidden, BD = D padded to a power of two. Grid (N,): one program a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, s_x, s_y, eps, BD: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BD)
    m = offs < D
    x = tl.load(x_ptr + r * s_x + offs, mask=m, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * s_y + offs, (x * scale * w).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [N, D] (rows contiguous) -> [N, D] in dtype (see norm.rms_norm_cast)."""
    N, D = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(N, D, dtype=dtype, device=x.device)
    bd = triton.next_power_of_2(D)
    _rms_norm_kernel[(N,)](x, w, y, D, x.stride(0), y.stride(0), float(eps), BD=bd,
                           num_warps=min(16, max(4, bd // 512)))
    return y
