"""Shared helpers of the kernel tests: random shards, poisoned outputs, per-dtype tolerances."""
from __future__ import annotations

import torch

# Relative L2 error allowed against the float64 reference: fp32 accumulation leaves ~1e-6;
# fp16 / bf16 outputs are rounded once (2^-11 / 2^-8 relative per element).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DENSITIES = (0.0, "one", 0.01, 0.10, 0.50, 1.0)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64 (inf if y has a NaN or inf)."""
    y = y.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(y).all():
        return float("inf")
    den = ref.norm().item()
    return (y - ref).norm().item() / (den if den > 0 else 1.0)


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def n_active(density, N: int) -> int:
    if density == "one":
        return 1
    return 0 if density == 0 else max(1, round(density * N))


def make_shard(N: int, D: int, dtype, act: str, bias: bool, gen: torch.Generator, device="cpu"):
    """up, gate (None for relu), down_t [N, D] and up_bias [N] or None; pre-activations ~ N(0, 1)."""
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    up = r(N, D, scale=D ** -0.5)
    gate = None if act == "relu" else r(N, D, scale=D ** -0.5)
    down_t = r(N, D)
    up_bias = r(N, scale=0.5) if bias else None
    return up, gate, down_t, up_bias


def make_idx(K: int, N: int, gen: torch.Generator, dtype=torch.int64, device="cpu") -> torch.Tensor:
    """K distinct neuron ids in random order."""
    return torch.randperm(N, generator=gen)[:K].to(dtype).to(device)
