"""kernels.norm: the residual's RMS norm cast to the compute dtype, against float64."""
from __future__ import annotations

import pytest
import torch

from powerinfer_ray.kernels.norm import rms_norm_cast, rms_norm_ref


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_rms_norm_cast_matches_float64(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 96, generator=gen) * 5
    w = torch.rand(96, generator=gen) + 0.5
    y = rms_norm_cast(x, w, 1e-6, dtype)
    want = rms_norm_ref(x, w, 1e-6)
    assert y.dtype == dtype
    assert float((y.double() - want).abs().max() / want.abs().max()) < tol
