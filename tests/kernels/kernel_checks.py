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


def threshold_in_gap(crit: torch.Tensor, q: float) -> float:
    """A threshold near the q-quantile of crit, in the middle of the widest gap between neighbouring
    values there (so kernels and the float64 reference, whose criteria differ by rounding, split
    the values the same way)."""
    s = crit.double().flatten().sort().values
    n = s.numel()
    lo, hi = max(0, int(q * n) - n // 20), min(n - 1, int(q * n) + n // 20)
    gaps = s[lo + 1:hi + 1] - s[lo:hi]
    i = lo + int(gaps.argmax())
    assert float(gaps.max()) > 1e-4, f"no gap near the {q} quantile"
    return float((s[i] + s[i + 1]) / 2)


def swiglu_oracle(x, up, gate, down_t, idx, t: float, on: str, mask=None) -> torch.Tensor:
    """The thresholded SwiGLU over rows idx (and the bool mask [T, K]) in float64 from the model's
    own definitions (model.reference: ffn_activation, threshold_criterion), an independent check
    of the kernels' activation threshold: [T, D]."""
    from powerinfer_ray.model.reference import ffn_activation, threshold_criterion

    rows = idx.long()
    xd = x.double()
    u, g = xd @ up[rows].double().T, xd @ gate[rows].double().T  # [T, K]
    h = ffn_activation("swiglu", u, g)
    h = torch.where(threshold_criterion(on, g, h) > t, h, torch.zeros((), dtype=h.dtype))
    return (h if mask is None else h * mask) @ down_t[rows].double()


def swiglu_case(N: int, D: int, T: int, dtype, on: str, gen: torch.Generator, q: float = 0.5):
    """(x, up, gate, down_t, threshold) of a SwiGLU shard with a threshold at the q-quantile of
    the criterion over all N rows (in a gap: see threshold_in_gap)."""
    from powerinfer_ray.model.reference import threshold_criterion

    up, gate, down_t, _ = make_shard(N, D, dtype, "swiglu", False, gen)
    x = torch.randn(T, D, generator=gen).to(dtype)
    g, u = x.double() @ gate.double().T, x.double() @ up.double().T
    crit = threshold_criterion(on, g, torch.nn.functional.silu(g) * u)
    return x, up, gate, down_t, threshold_in_gap(crit, q)
