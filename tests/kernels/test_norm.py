"""kernels.norm: the residual's RMS norm cast to the compute dtype, against float64."""
from __future__ import annotations

import pytest
import torch

from powerinfer_ray.kernels.norm import add_rms_norm, rms_norm_cast, rms_norm_ref


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_rms_norm_cast_matches_float64(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 96, generator=gen) * 5
    w = torch.rand(96, generator=gen) + 0.5
    y = rms_norm_cast(x, w, 1e-6, dtype)
    want = rms_norm_ref(x, w, 1e-6)
    assert y.dtype == dtype
    assert float((y.double() - want).abs().max() / want.abs().max()) < tol


def test_add_rms_norm_adds_parts_and_bias_in_place_then_norms():
    """The residual gains every partial output (any dtype) and the bias, in place; the norm is of
    the sum (float64 references)."""
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 96, generator=gen) * 5
    parts = [torch.randn(2, 96, generator=gen).half(), torch.randn(2, 96, generator=gen)]
    b, w = torch.randn(96, generator=gen), torch.rand(96, generator=gen) + 0.5
    want_h = h.double() + parts[0].double() + parts[1].double() + b.double()
    y = add_rms_norm(h, parts, b, w, 1e-6, torch.float32)
    assert float((h.double() - want_h).abs().max()) < 1e-5
    want = rms_norm_ref(want_h, w, 1e-6)
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-6
