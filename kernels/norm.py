"""RMS norm of the fp32 residual into the compute dtype: one Triton launch on CUDA (a decode
step's norm is one row: the norm and the cast as separate kernels cost more than the row's
bytes), torch elsewhere; `rms_norm_ref` (float64) beside it. `add_rms_norm` first adds a layer's
partial outputs and bias to the residual, in the same launch."""
from __future__ import annotations

import torch

_triton_failed = False


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 x / sqrt(mean(x^2) + eps) * w over the last axis."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def rms_norm_cast(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [N, D] (fp32) -> rms_norm(x) * w [N, D] in dtype, computed in fp32."""
    global _triton_failed
    if x.is_cuda and x.dim() == 2 and not _triton_failed:
        try:
            from . import triton_norm
            return triton_norm.rms_norm_triton(x, w, eps, dtype)
        except ImportError:
            _triton_failed = True
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)


def add_rms_norm(h: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None, w: torch.Tensor,
                 eps: float, dtype: torch.dtype) -> torch.Tensor:
    """h += each of parts [N, D] (any float dtype, on h's device or, on CUDA, in page-locked host
    memory seen through a device view), then bias [D], in place in the fp32 residual h [N, D], in
    that order; returns rms_norm(h) * w [N, D] in dtype. One Triton launch on CUDA for up to four
    parts."""
    global _triton_failed
    if h.is_cuda and h.dim() == 2 and len(parts) <= 4 and not _triton_failed:
        try:
            from . import triton_norm
            return triton_norm.add_rms_norm_triton(h, parts, bias, w, eps, dtype)
        except ImportError:
            _triton_failed = True
    for p in parts:
        h += p
    if bias is not None:
        h += bias
    return rms_norm_cast(h, w, eps, dtype)
