"""Triton kernels of `norm.rms_norm_cast` (a row's RMS norm and the cast to the compute dtype in one
launch) and `norm.add_rms_norm` (the partial outputs' sum into the residual first), imported
lazily: triton is optional.

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


@triton.jit
def _add_rms_norm_kernel(h_ptr, p0, p1, p2, p3, b_ptr, w_ptr, y_ptr, D, s_h, s0, s1, s2, s3, s_y, eps,
                         NP: tl.constexpr, HAS_BIAS: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BD)
    m = offs < D
    h = tl.load(h_ptr + r * s_h + offs, mask=m, other=0.0)
    if NP > 0:
        h += tl.load(p0 + r * s0 + offs, mask=m, other=0.0).to(tl.float32)
    if NP > 1:
        h += tl.load(p1 + r * s1 + offs, mask=m, other=0.0).to(tl.float32)
    if NP > 2:
        h += tl.load(p2 + r * s2 + offs, mask=m, other=0.0).to(tl.float32)
    if NP > 3:
        h += tl.load(p3 + r * s3 + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + r * s_h + offs, h, mask=m)
    scale = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * s_y + offs, (h * scale * w).to(y_ptr.dtype.element_ty), mask=m)


def add_rms_norm_triton(h: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None, w: torch.Tensor,
                        eps: float, dtype: torch.dtype) -> torch.Tensor:
    """h [N, D] fp32 (rows contiguous) += parts (<= 4, [N, D], rows contiguous) + bias; returns the
    norm [N, D] in dtype (see norm.add_rms_norm)."""
    N, D = h.shape
    assert h.dtype == torch.float32 and h.stride(1) == 1 and len(parts) <= 4
    parts = [p if p.stride(-1) == 1 else p.contiguous() for p in parts]
    ps = parts + [h] * (4 - len(parts))  # unused slots: never read
    y = torch.empty(N, D, dtype=dtype, device=h.device)
    bd = triton.next_power_of_2(D)
    _add_rms_norm_kernel[(N,)](h, *ps, bias if bias is not None else h, w, y, D, h.stride(0),
                               *(p.stride(0) for p in ps), y.stride(0), float(eps), NP=len(parts),
                               HAS_BIAS=bias is not None, BD=bd, num_warps=min(16, max(4, bd // 512)))
    return y
