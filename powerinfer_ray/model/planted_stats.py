"""Planted statistics: the power law each layer's activation probabilities follow, calibrated to
a mean and a top share, and the per-layer plan (probabilities, residual rms, down-projection
scale) the row generators read."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .planted_random import BLOCK_ROWS, VAR8
from .planted_spec import PlantedSpecError

P_MAX, P_MIN = 0.999, 1e-6  # planted probabilities are clipped to these (Phi^-1 stays finite)
ATTN_VAR, FFN_VAR = 0.25, 0.75  # per-dim variance all attention / all FFN outputs add to the stream
POS_VAR = 0.1  # per-dim variance of OPT's learned position rows


# ------------------------------------------------------------------------------------------------
# calibration: p(rank) = min(p_max, a * rank^-b)
# ------------------------------------------------------------------------------------------------
def power_law_for_mean(n: int, b: float, mean: float, p_max: float = P_MAX,
                       log_rank: np.ndarray | None = None) -> np.ndarray:
    """p [n] sorted hot -> cold, ``min(p_max, a * rank^-b)`` with ``a`` solved so p.mean() == mean.

    Exact in one pass: if the n_sat hottest ranks saturate, mean = (n_sat p_max + a T) / n with
    T the tail sum of rank^-b; the mean reached when one more rank saturates grows with n_sat,
    so a search over n_sat finds the segment and then a.
    """
    assert 0 < mean < p_max, f"mean activation {mean} must lie in (0, {p_max})"
    lr = np.log(np.arange(1, n + 1, dtype=np.float64)) if log_rank is None else log_rank
    w = np.exp(-b * lr)  # [n] rank^-b
    tail = np.cumsum(w[::-1])[::-1]  # tail[i] = sum_{j >= i} w_j
    reach = (np.arange(n) * p_max + p_max / w * tail) / n  # mean when rank sat+1 just saturates
    k = int(np.searchsorted(reach, mean))
    a = (n * mean - k * p_max) / tail[k]
    return np.clip(np.minimum(p_max, a * w), P_MIN, p_max)


def top_share(p: np.ndarray, top_frac: float) -> float:
    """Share of all activations carried by the hottest ``top_frac`` of neurons."""
    s = np.sort(p)[::-1]
    return float(s[: max(1, round(top_frac * len(s)))].sum() / s.sum())


def calibrate(n: int, mean: float, top_frac: float, share: float, p_max: float = P_MAX) -> tuple[np.ndarray, float]:
    """(p sorted hot -> cold, exponent b): the power law with this mean whose hottest ``top_frac``
    carry ``share``. At a fixed mean the share grows with b (b = 0 is uniform: share = top_frac),
    so a bracketing root search on b (Illinois regula falsi) finds it in a dozen steps."""
    if not top_frac < share < 1.0:
        raise PlantedSpecError(f"top share {share} must lie in ({top_frac}, 1) for top_frac={top_frac}")
    lr, n_top = np.log(np.arange(1, n + 1, dtype=np.float64)), max(1, round(top_frac * n))

    def excess(b: float) -> tuple[float, np.ndarray]:
        p = power_law_for_mean(n, b, mean, p_max, lr)  # sorted hot -> cold
        return p[:n_top].sum() / p.sum() - share, p

    lo, hi = 0.0, 16.0
    f_lo, f_hi = excess(lo)[0], excess(hi)[0]
    if f_hi < 0:
        raise PlantedSpecError(f"top share {share} unreachable with mean {mean} (p_max {p_max})")
    side = 0
    for _ in range(100):
        b = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f, p = excess(b)
        if abs(f) < 1e-9 or hi - lo < 1e-12:
            return p, b
        if f < 0:
            lo, f_lo = b, f
            f_hi, side = (f_hi / 2, -1) if side == -1 else (f_hi, -1)
        else:
            hi, f_hi = b, f
            f_lo, side = (f_lo / 2, 1) if side == 1 else (f_lo, 1)
    return p, b

def relu_moments(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E[relu(z)], E[relu(z)^2] for z ~ N(m, 1)."""
    t = torch.as_tensor(m, dtype=torch.float64)
    cdf, pdf = torch.special.ndtr(t), torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)
    return (t * cdf + pdf).numpy(), ((t * t + 1) * cdf + t * pdf).numpy()


def thresholded_silu_sq(m: np.ndarray, gate: float, n: int = 801) -> np.ndarray:
    """E[SiLU(g)^2 ; g > gate] for g ~ N(m + gate, 1): the second moment of a thresholded SwiGLU
    neuron's gate factor (its neuron fires iff g > gate, with probability Phi(m)). Midpoint rule
    over z in [-10, 10] (the tails beyond add < 1e-20)."""
    z = np.linspace(-10.0, 10.0, n + 1)
    z = (z[1:] + z[:-1]) / 2  # [n] midpoints
    w = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (20.0 / n)  # [n] N(0, 1) weights
    out = np.empty(len(m))
    for a in range(0, len(m), 4096):  # [chunk, n] at a time
        g = m[a:a + 4096, None] + gate + z[None, :]
        out[a:a + 4096] = ((g / (1.0 + np.exp(-g))) ** 2 * (g > gate)) @ w
    return out


def down_plan(p: np.ndarray, gated: bool, out_var: float, gate_shift: float = 0.0) -> tuple[np.ndarray, float]:
    """(E[h_j] on a 2^-20 grid (0 when gated), scale of ffn_down_t's ints) so that the FFN adds
    ``out_var`` per residual dim: sum_j Var(h_j) |d_j|^2 = out_var. ReGLU: h_j = relu(z_g) z_u
    with a zero-mean, unit-variance up factor, Var = E[relu(z_g)^2]. Thresholded SwiGLU
    (gate_shift > 0: the gate value at the threshold): h_j = SiLU(g) z_u where g > gate_shift,
    else 0, Var = ``thresholded_silu_sq``. Plain ReLU: the mean E[relu(z)] is projected out of
    each block of ffn_down_t, so Var = E[h^2] - E[h]^2, times the share of |d_j|^2 the
    projection leaves."""
    m = torch.special.ndtri(torch.as_tensor(p)).numpy()
    mean_h, sq_h = relu_moments(m)
    relu_mean = np.zeros(len(p)) if gated else np.round(mean_h * 2**20) / 2**20
    if gate_shift:
        var_h = thresholded_silu_sq(m, gate_shift)
    else:
        var_h = sq_h if gated else (sq_h - mean_h**2) * _projected_norm2(relu_mean)
    return relu_mean, math.sqrt(out_var / (float(var_h.sum()) * VAR8))


def _projected_norm2(e: np.ndarray) -> np.ndarray:
    """[F] expected |d_j'|^2 / |d_j|^2 after a block's mean direction sum_j e_j d_j is projected
    out of its rows (see PlantedModel._gen_down): 1 - e_j^2 / sum_{i in block} e_i^2. Hot neurons
    dominate their block's mean, so they lose a visible part of their output; the down scale
    makes up for it."""
    pad = (-len(e)) % BLOCK_ROWS
    e2 = np.concatenate([e, np.zeros(pad)]).reshape(-1, BLOCK_ROWS) ** 2
    nu = np.maximum(e2.sum(axis=1, keepdims=True), 1e-300)
    return (1.0 - e2 / nu).reshape(-1)[: len(e)]


@dataclass
class LayerPlan:
    """Everything small about one layer, in neuron-id order (F = n_ff)."""

    p: np.ndarray  # [F] planted activation probability
    q: np.ndarray  # [F] probability the predictor marks the neuron
    b: float  # power-law exponent of p
    r_attn: float  # planned per-dim rms of the residual's rest at the attention input
    r_ffn: float  # ... at the FFN input (and the predictor input)
    down_scale: float  # scale of ffn_down_t's random ints
    relu_mean: np.ndarray  # [F] E[h_j] for plain ReLU (0 for gated), on a 2^-20 grid
    gate_shift: float = 0.0  # thresholded SwiGLU: the gate value at the threshold (planted_spec.SWIGLU_GATE)
    # the second token range's p and q (spec ``ranges=2``; None: one range), another draw of the same law
    p_b: np.ndarray | None = None
    q_b: np.ndarray | None = None
    m: np.ndarray = field(init=False)  # [F] Phi^-1(p) (+ gate_shift): the gate's bias-channel coefficient
    mq: np.ndarray = field(init=False)  # [F] Phi^-1(q)
    m_b: np.ndarray | None = field(init=False)  # the second range's m and mq
    mq_b: np.ndarray | None = field(init=False)

    def __post_init__(self) -> None:
        ndtri = lambda x: torch.special.ndtri(torch.as_tensor(x)).numpy()  # noqa: E731
        self.m, self.mq = ndtri(self.p) + self.gate_shift, ndtri(self.q)
        two = self.p_b is not None
        self.m_b, self.mq_b = (ndtri(self.p_b) + self.gate_shift, ndtri(self.q_b)) if two else (None, None)
