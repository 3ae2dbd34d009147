"""RMS norm of the fp32 residual into the compute dtype: one Triton launch on CUDA (a decode
step's norm is one row: the norm and the cast as separate kernels cost more than the row's
bytes), torch elsewhere; `rms_norm_ref` (float64) beside it."""
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
