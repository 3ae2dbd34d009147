"""Planted sparse models at real shapes: synthetic weights whose FFN neurons fire with planted,
power-law-distributed probabilities in the model's own forward pass, plus predictors that match.

Benchmarks cannot download checkpoints, so ``planted:<preset>?dtype=f16&seed=0[&layers=N]``
(see ``source.open_model``) stands for a Llama-2 / Falcon / OPT model of the real shape. Nothing
is stored: every tensor is generated on demand, row block by row block, from a counter-based
hash of (seed, tensor, layer, block), so an executor materialises only its shard and every
device (CPU or CUDA) produces bit-identical rows.

How the sparsity is planted (dimension legend of ``config.py``; c = the bias channel, dim 0):

* Residual dim c is a constant "bias channel": every embedding row holds ``C_VALUE`` there and
  no attention or FFN output writes it (row c of attn_output, column c of ffn_down_t are 0).
  Every other residual dim ("rest") of an embedding row is random with rms exactly 1.
* Gate row j (ReGLU) or up row j (plain ReLU) is ``g_j = rho * a_j + sqrt(1 - rho^2) * e_j``
  on the rest dims (a_j, e_j unit vectors, see below) and ``m_j * |g_j|`` on dim c, with
  ``m_j = Phi^-1(p_j)``. The norm weight of dim c at the FFN input is ``r_l / C_VALUE`` where
  r_l is the planned per-dim rms of the residual's rest at that point. Then, whatever the
  token, ``g_j . norm(x)`` is (up to the positive 1/rms factor both parts share)
  ``g_j . x_rest + m_j |g_j| r_l``; with x_rest ~ isotropic of per-dim variance r_l^2 the first
  term is ~N(0, |g_j|^2 r_l^2), so P(neuron j fires) = Phi(m_j) = p_j.
* The residual's growth is planned so r_l is known: the attention and FFN outputs of each
  layer add variance ATTN_VAR / L and FFN_VAR / L per dim. The down projection's scale comes
  from the planted probabilities (Var(h_j) summed over neurons); for plain ReLU the mean output
  (E[relu(z)] > 0) is projected out of each row block of ffn_down_t so no constant drift builds
  up in the stream. Query rows copy their KV head's key rows (plus small noise), so attention
  mostly attends to the token itself and its output variance is that of v (predictable).
  Measured (dense forward, f32): the rest's rms stays within 0.3 % of the plan over 40-60
  layers at D = 512, and per-layer active shares within 3 % of the planted mean.
* a_j = u_j P / |u_j P|: P [k, D] is a CountSketch of the rest dims (each rest dim belongs to
  one of k buckets, with a random sign), u_j [k] small random integers. The predictor
  ``fc1 = [P; -P; bias row]``, ``fc2_j = rho * [u_j, -u_j] / |u_j P|, rho * Phi^-1(q_j)`` computes
  ``rho * a_j . x_rest + rho * Phi^-1(q_j) r_l`` exactly (relu(Px) - relu(-Px) = Px), i.e. it sees
  the part rho of the gate direction and marks neuron j with probability q_j. The part
  sqrt(1 - rho^2) e_j is what a trained predictor would miss; rho (default 0.98) sets its recall.
* p_j (true activation) and q_j (predictor marks) follow ``min(p_max, a * rank^-b)``, calibrated
  per layer (slightly jittered, seeded) so that the mean and the share carried by the top
  ``top_frac`` of neurons hit the published statistics; neuron ids are randomly permuted.

Every random integer comes from splitmix64 over int64 lanes, every reduction is over small
integers (exact in fp32/fp64, so its order does not matter) and every other step is one IEEE
operation per element, so generation is subset-consistent and, by construction, gives the same
bits on CPU and CUDA (the CUDA path is not exercised by the CPU tests). Generating on the GPU
and copying to the host is the fast way to materialise a CPU shard on the GPU host.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import parse_qsl

import numpy as np
import torch

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_config import config_to_fields, expected_shapes
from .gguf_writer import LazyTensor, write_model
from .tokenizer import BYTE_VOCAB_SIZE, byte_level_fields

BLOCK_ROWS = 256  # rows per generation block: the unit of determinism
CHANNEL = 0  # the residual dim used as the constant bias channel
C_VALUE = 1.0  # its value in every embedding row (same scale as the other dims)
P_MAX, P_MIN = 0.999, 1e-6  # planted probabilities are clipped to these (Phi^-1 stays finite)
ATTN_VAR, FFN_VAR = 0.25, 0.75  # per-dim variance all attention / all FFN outputs add to the stream
POS_VAR = 0.1  # per-dim variance of OPT's learned position rows
SELF_SCORE = 10.0  # q_t . k_t / sqrt(hd): attention mostly attends to the token itself
LOGIT_STD = 2.5  # std of the output logits
JITTER_MEAN, JITTER_SHARE = 0.06, 0.015  # per-layer variation: log-mean std, top-share std
if TYPE_CHECKING:
    from .reference import ReferenceModel

_VAR8, _VAR4 = (256**2 - 1) / 3, (16**2 - 1) / 3  # variance of odd ints in [-255, 255] / [-15, 15]
_TORCH_DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class PlantedSpecError(ValueError):
    """A ``planted:`` spec that names an unknown preset or option, or a bad value."""


# ------------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Targets:
    """Published activation statistics a preset is calibrated to (per layer, per token)."""

    active: float  # mean fraction of FFN neurons active per token (the model's own ReLU)
    marked: float  # mean fraction the predictor marks active per token
    top_frac: float  # the hottest top_frac of neurons ...
    top_share: float  # ... carry this share of all activations


@dataclass(frozen=True)
class Preset:
    config: dict[str, Any]  # ModelConfig fields (without dtype / predictor_ranks)
    targets: Targets
    ranks: tuple[int, int]  # predictor width r of the first and last layer (linear ramp)
    note: str = ""


_LLAMA = dict(arch="llama", ffn_act="reglu", n_vocab=32000, n_ctx=4096, norm_eps=1e-5)
PRESETS: dict[str, Preset] = {
    # ReluLLaMA-7B as upstream's generator plants it: 14.5 % active, top 20 % carry 81 %
    "llama2-7b": Preset(dict(_LLAMA, n_embd=4096, n_layer=32, n_head=32, n_head_kv=32, n_ff=11008),
                        Targets(0.145, 0.145, 0.2, 0.81), (1024, 1536)),
    # ReluLLaMA-13B: ~78 % sparse (22 % active), top 20 % carry 79 %; upstream's planted
    # predictors mark 15.6 % per token with widths 1024 -> 2048 (DESIGN.md section 3)
    "llama2-13b": Preset(dict(_LLAMA, n_embd=5120, n_layer=40, n_head=40, n_head_kv=40, n_ff=13824),
                         Targets(0.22, 0.156, 0.2, 0.79), (1024, 2048)),
    # PowerInfer paper: 43 % of LLaMA(ReGLU)-70B neurons carry 80 % of activations; the mean
    # (20 %) is an assumption in line with the 7B/13B models
    "llama2-70b": Preset(dict(_LLAMA, n_embd=8192, n_layer=80, n_head=64, n_head_kv=8, n_ff=28672),
                         Targets(0.20, 0.20, 0.43, 0.80), (1024, 2048)),
    # ReluFalcon-40B: ~5 % active; concentration assumed like OPT (26 % carry 80 %); widths
    # 1024 -> 1920 make the predictors 3.6 G params = 6.7 GiB fp16, upstream's figure (8.65 %)
    "falcon-40b": Preset(dict(arch="falcon", ffn_act="relu", n_vocab=65024, n_embd=8192, n_layer=60,
                              n_head=128, n_head_kv=8, n_ff=32768, n_ctx=2048, parallel_attn=True,
                              two_norms=True, tied_output=True),
                         Targets(0.05, 0.05, 0.26, 0.80), (1024, 1920)),
    # OPT-30B: 95-98 % sparse (4 % active); PowerInfer paper: 26 % of neurons carry 80 %
    "opt-30b": Preset(dict(arch="opt", ffn_act="relu", n_vocab=50272, n_embd=7168, n_layer=48, n_head=56,
                           n_head_kv=56, n_ff=28672, n_ctx=2048, bias=True, tied_output=True),
                      Targets(0.04, 0.04, 0.26, 0.80), (1024, 2048)),
    # tiny models with the same machinery, for tests (13B-like / Falcon-like statistics)
    "tiny": Preset(dict(_LLAMA, n_vocab=512, n_ctx=512, n_embd=128, n_layer=4, n_head=4, n_head_kv=4,
                        n_ff=512), Targets(0.22, 0.156, 0.2, 0.79), (64, 128)),
    "tiny-opt": Preset(dict(arch="opt", ffn_act="relu", n_vocab=512, n_ctx=512, n_embd=128, n_layer=4,
                            n_head=4, n_head_kv=4, n_ff=512, bias=True, tied_output=True),
                       Targets(0.05, 0.05, 0.26, 0.80), (64, 128)),
    "tiny-falcon": Preset(dict(arch="falcon", ffn_act="relu", n_vocab=512, n_ctx=512, n_embd=128,
                               n_layer=4, n_head=4, n_head_kv=2, n_ff=512, parallel_attn=True,
                               two_norms=True, tied_output=True),
                          Targets(0.05, 0.05, 0.26, 0.80), (64, 128)),
}


def predictor_ranks(r0: int, r1: int, n_layer: int) -> tuple[int, ...]:
    """Widths ramping linearly from r0 (layer 0) to r1 (last layer), multiples of 64 (or 8 when
    tiny)."""
    q = 64 if min(r0, r1) >= 256 else 8
    return tuple(int(round((r0 + (r1 - r0) * l / max(n_layer - 1, 1)) / q) * q) for l in range(n_layer))


@dataclass(frozen=True)
class PlantedSpec:
    """A parsed ``<preset>?key=value&...`` spec."""

    preset: str
    dtype: str = "f16"
    seed: int = 0
    layers: int | None = None  # keep only the first N layers (the same weights as the full model)
    active: float | None = None  # override Targets.active
    marked: float | None = None  # override Targets.marked
    top_share: float | None = None  # override Targets.top_share
    rho: float = 0.98  # predictor fidelity: share of the gate direction the predictor sees

    @property
    def targets(self) -> Targets:
        t = PRESETS[self.preset].targets
        return Targets(self.active if self.active is not None else t.active,
                       self.marked if self.marked is not None else t.marked, t.top_frac,
                       self.top_share if self.top_share is not None else t.top_share)


_SPEC_KEYS = {"dtype": str, "seed": int, "layers": int, "active": float, "marked": float,
              "top_share": float, "rho": float}


def parse_spec(spec: str) -> PlantedSpec:
    """``"llama2-13b?dtype=f16&seed=0&layers=2"`` -> PlantedSpec; ValueError naming what is bad."""
    name, _, query = spec.partition("?")
    if name not in PRESETS:
        raise PlantedSpecError(f"planted model {name!r}: expected one of {sorted(PRESETS)}")
    kw: dict[str, Any] = {}
    for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if k not in _SPEC_KEYS:
            raise PlantedSpecError(f"planted spec {spec!r}: unknown option {k!r}, expected one of {sorted(_SPEC_KEYS)}")
        try:
            kw[k] = _SPEC_KEYS[k](v)
        except ValueError:
            raise PlantedSpecError(f"planted spec {spec!r}: {k}={v!r} is not a {_SPEC_KEYS[k].__name__}") from None
    s = PlantedSpec(name, **kw)
    full_l = PRESETS[name].config["n_layer"]
    checks = [("dtype", s.dtype, s.dtype in _TORCH_DT, "f16, bf16 or f32"),
              ("layers", s.layers, s.layers is None or 1 <= s.layers <= full_l, f"1..{full_l}"),
              ("rho", s.rho, 0.0 < s.rho <= 1.0, "in (0, 1]")]
    checks += [(k, getattr(s, k), getattr(s, k) is None or 0.0 < getattr(s, k) < 1.0, "in (0, 1)")
               for k in ("active", "marked", "top_share")]
    for what, got, ok, expected in checks:
        if not ok:
            raise PlantedSpecError(f"planted spec {spec!r}: {what} is {got!r}, expected {expected}")
    return s


def preset_config(spec: str | PlantedSpec) -> ModelConfig:
    """The ModelConfig of a planted spec (cheap: nothing is generated)."""
    s = parse_spec(spec) if isinstance(spec, str) else spec
    p = PRESETS[s.preset]
    full_l = p.config["n_layer"]
    ranks = predictor_ranks(*p.ranks, full_l)[: s.layers or full_l]
    return ModelConfig(**dict(p.config, n_layer=s.layers or full_l), dtype=s.dtype, sparse_threshold=0.0,
                       predictor_ranks=ranks, name=f"planted-{s.preset}", extra={"planted": s})


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


# ------------------------------------------------------------------------------------------------
# counter-based random integers (splitmix64 over int64 lanes; identical on every device)
# ------------------------------------------------------------------------------------------------
def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def stream_key(seed: int, *parts: Any) -> int:
    """A 64-bit key for one random stream, e.g. (seed, template, layer, block)."""
    h = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes."""
    return (z >> s) & ((1 << (64 - s)) - 1)


_STEPS = {}  # (n_words, device) -> (i + 1) * gamma [W]: the counters of every stream


def splitmix64(keys: torch.Tensor, n_words: int) -> torch.Tensor:
    """keys [S] int64 -> [S, n_words] int64: word i of stream s is splitmix64(key_s + (i+1) gamma).
    int64 multiplication wraps modulo 2^64 on CPU and CUDA alike; ops run in place."""
    steps = _STEPS.get((n_words, keys.device))
    if steps is None:
        steps = torch.arange(1, n_words + 1, dtype=torch.int64, device=keys.device) * _GAMMA
        if len(_STEPS) >= 16:  # a handful of widths recur (one per tensor kind)
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[(n_words, keys.device)] = steps
    z = keys[:, None] + steps[None, :]  # [S, W]
    t = torch.empty_like(z)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        t &= (1 << (64 - shift)) - 1  # logical shift
        z ^= t
        if mult is not None:
            z *= mult
    return z


def odd_ints(keys: torch.Tensor, n: int, bits: int = 8) -> torch.Tensor:
    """keys [S] -> [S, n] float32 odd integers uniform in [-(2^bits - 1), 2^bits - 1] (mean 0,
    variance (4^bits - 1) / 3), from the little-endian bytes of the streams."""
    words = splitmix64(keys, (n + 7) // 8)  # [S, W]
    if bits == 8:  # a byte read as int8 b in [-128, 127] -> 2b + 1
        out = torch.mul(words.view(torch.int8)[:, :n], 2.0)
        return out.add_(1.0)
    assert bits == 4, f"bits={bits}: expected 4 or 8"
    nib = words.view(torch.uint8)[:, :n] & 15
    return torch.mul(nib, 2.0).sub_(15.0)


def _keys(seed: int, parts: tuple, blocks: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.tensor([stream_key(seed, *parts, int(b)) for b in blocks], dtype=torch.int64, device=device)


def block_ints(seed: int, parts: tuple, blocks: np.ndarray, cols: int, bits: int,
               device: torch.device) -> torch.Tensor:
    """Random odd ints of whole row blocks: [len(blocks) * BLOCK_ROWS, cols] float32."""
    x = odd_ints(_keys(seed, parts, blocks, device), BLOCK_ROWS * cols, bits)  # [nb, B*cols]
    return x.view(len(blocks) * BLOCK_ROWS, cols)


def _row_norm(x: torch.Tensor) -> torch.Tensor:
    """Exact L2 norm of rows of small integers: x [R, C] -> [R] float64 (order-independent)."""
    return (x * x).sum(dim=1, dtype=torch.float64).sqrt()


# ------------------------------------------------------------------------------------------------
# per-layer plan (small, numpy float64, computed once)
# ------------------------------------------------------------------------------------------------
def _std_normal(seed: int, what: str, n: int) -> np.ndarray:
    """n seeded N(0, 1) draws from the hash stream (inverse CDF of uniforms)."""
    w = splitmix64(torch.tensor([stream_key(seed, what)]), n)[0]
    u = (_srl(w, 11).double() + 0.5) / 2.0**53
    return torch.special.ndtri(u).numpy()


def relu_moments(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E[relu(z)], E[relu(z)^2] for z ~ N(m, 1)."""
    t = torch.as_tensor(m, dtype=torch.float64)
    cdf, pdf = torch.special.ndtr(t), torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)
    return (t * cdf + pdf).numpy(), ((t * t + 1) * cdf + t * pdf).numpy()


def _down_plan(p: np.ndarray, gated: bool, out_var: float) -> tuple[np.ndarray, float]:
    """(E[h_j] on a 2^-20 grid (0 when gated), scale of ffn_down_t's ints) so that the FFN adds
    ``out_var`` per residual dim: sum_j Var(h_j) |d_j|^2 = out_var. ReGLU: h_j = relu(z_g) z_u
    with a zero-mean, unit-variance up factor, Var = E[relu(z_g)^2]. Plain ReLU: the mean
    E[relu(z)] is projected out of each block of ffn_down_t, so Var = E[h^2] - E[h]^2, times the
    share of |d_j|^2 the projection leaves."""
    mean_h, sq_h = relu_moments(torch.special.ndtri(torch.as_tensor(p)).numpy())
    relu_mean = np.zeros(len(p)) if gated else np.round(mean_h * 2**20) / 2**20
    var_h = sq_h if gated else (sq_h - mean_h**2) * _projected_norm2(relu_mean)
    return relu_mean, math.sqrt(out_var / (float(var_h.sum()) * _VAR8))


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
    m: np.ndarray = field(init=False)  # [F] Phi^-1(p)
    mq: np.ndarray = field(init=False)  # [F] Phi^-1(q)

    def __post_init__(self) -> None:
        self.m = torch.special.ndtri(torch.as_tensor(self.p)).numpy()
        self.mq = torch.special.ndtri(torch.as_tensor(self.q)).numpy()


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
Gen = Callable[[int, np.ndarray, torch.device], torch.Tensor]  # (layer, blocks, device) -> [nb*B, cols]


class PlantedModel:
    """A planted model as a ``WeightSource``: rows are generated when asked for.

    ``layer(template, bid, rows)`` returns exactly those rows of the full tensor, generating only
    the BLOCK_ROWS-row blocks that hold them; any device gives the same bits.
    """

    def __init__(self, spec: str | PlantedSpec) -> None:
        self.spec = parse_spec(spec) if isinstance(spec, str) else spec
        self.preset = PRESETS[self.spec.preset]
        self.config = preset_config(self.spec)
        self.full_layers = self.preset.config["n_layer"]  # the plan is that of the full model
        self.fields = _fields(self.config)
        self.shapes = expected_shapes(self.config)
        self._plans: dict[int, LayerPlan] = {}
        self._sketch: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._jitter = _std_normal(self.spec.seed, "layer-jitter", 2 * self.full_layers).reshape(2, -1)
        self._jitter -= self._jitter.mean(axis=1, keepdims=True)
        self._gens = self._generators()
        self._names = _name_index(self.config, self.shapes)

    def __repr__(self) -> str:
        return f"PlantedModel({self.spec.preset!r}, dtype={self.spec.dtype}, seed={self.spec.seed}, layers={self.config.n_layer})"

    # --- statistics ------------------------------------------------------------------------
    def plan(self, l: int) -> LayerPlan:
        """The layer's planted statistics and scales (cached)."""
        if l not in self._plans:
            self._plans[l] = self._make_plan(l)
        return self._plans[l]

    def _make_plan(self, l: int) -> LayerPlan:
        c, F = self.config, self.config.n_ff
        active, marked, share = self._layer_targets(l)
        p_rank, b = calibrate(F, active, self.spec.targets.top_frac, share)
        q_rank, _ = calibrate(F, marked, self.spec.targets.top_frac, share)
        order = self.permutation(l)  # order[i] = neuron id of rank i
        p, q = np.empty(F), np.empty(F)
        p[order], q[order] = p_rank, q_rank
        # the residual's rest grows by (ATTN_VAR + FFN_VAR) / L per layer from the embedding's 1
        L = self.full_layers
        var_in = (1.0 + (POS_VAR if c.arch == "opt" else 0.0)) + l * (ATTN_VAR + FFN_VAR) / L
        var_ffn = var_in if c.parallel_attn else var_in + ATTN_VAR / L
        relu_mean, down_scale = _down_plan(p, c.gated, FFN_VAR / L)
        return LayerPlan(p, q, b, math.sqrt(var_in), math.sqrt(var_ffn), down_scale, relu_mean)

    def _layer_targets(self, l: int) -> tuple[float, float, float]:
        """(active, marked, top share) of layer l: the targets with a seeded per-layer variation,
        centred over the full model's layers so the model-wide means hit the targets."""
        t = self.spec.targets
        scale = math.exp(JITTER_MEAN * self._jitter[0, l]) / float(np.mean(np.exp(JITTER_MEAN * self._jitter[0])))
        active, marked = min(t.active * scale, 0.9), min(t.marked * scale, 0.9)
        most = 0.98 * t.top_frac * P_MAX / max(active, marked)  # the top can carry no more
        share = t.top_share + JITTER_SHARE * self._jitter[1, l]
        return active, marked, float(np.clip(share, t.top_frac + 0.01, min(0.99, most)))

    def permutation(self, l: int) -> np.ndarray:
        """[F] neuron ids in rank order (hottest first): a seeded shuffle, so hot neurons are
        scattered over the rows."""
        keys = splitmix64(torch.tensor([stream_key(self.spec.seed, "perm", l)]), self.config.n_ff)[0]
        return np.argsort(keys.numpy(), kind="stable")

    def activation_probs(self, l: int) -> np.ndarray:
        """[F] planted probability that neuron j of layer l fires (its gate/up logit > 0)."""
        return self.plan(l).p.copy()

    def predictor_probs(self, l: int) -> np.ndarray:
        """[F] planted probability that the predictor marks neuron j (logit >= threshold 0)."""
        return self.plan(l).q.copy()

    def activation_counts(self, n_tokens: int = 1_000_000) -> tuple[list[np.ndarray], int]:
        """The planted statistics as a profile would report them: ([L][F] int64 counts, n_tokens)."""
        counts = [np.rint(self.plan(l).p * n_tokens).astype(np.int64) for l in range(self.config.n_layer)]
        return counts, int(n_tokens)

    # --- WeightSource ------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.shapes

    def layer(self, template: str, bid: int, rows: Any = None, dtype: torch.dtype | None = None,
              bias: bool = False, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows ``rows`` (all when None) of a per-layer tensor, by its template in ``gguf_keys``."""
        if not 0 <= bid < self.config.n_layer:
            raise PlantedSpecError(f"{self}: layer {bid} out of range 0..{self.config.n_layer - 1}")
        return self._tensor(K.tensor(template, bid, bias), (template, bias), bid, rows, dtype, device)

    def global_(self, name: str, dtype: torch.dtype | None = None, bias: bool = False,
                rows: Any = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """A model-level tensor (token_embd, output_norm, output, position_embd)."""
        return self._tensor(K.global_tensor(name, bias), (name, bias), 0, rows, dtype, device)

    def output_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output head [V, D] (the token embedding when tied)."""
        name = K.OUTPUT if self.has(K.global_tensor(K.OUTPUT)) else K.TOKEN_EMBD
        return self.global_(name, dtype)

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Any tensor by its full GGUF name (as ModelFile.get)."""
        if name not in self._names:
            raise PlantedSpecError(f"{self}: no tensor {name!r}")
        tmpl, l, bias = self._names[name]
        if l is None:
            return self.global_(tmpl, dtype, bias, device=device)
        return self.layer(tmpl, l, None, dtype, bias, device)

    def weights(self, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of the model by GGUF name (only sensible for small models)."""
        return {name: self.get(name, dtype, device) for name in self.shapes}

    def reference(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "ReferenceModel":
        """The dense ReferenceModel of this model (materialises every weight: small models only)."""
        from .reference import ReferenceModel

        w = self.weights(device=device)
        if self.config.tied_output:
            w[K.global_tensor(K.OUTPUT)] = w[K.global_tensor(K.TOKEN_EMBD)]
        return ReferenceModel(self.config, w, dtype, device)

    # --- generation ----------------------------------------------------------------------------
    def storage_dtype(self, name: str) -> str:
        """How a file stores the tensor: matrices at the model dtype, 1-D tensors at f32."""
        return self.spec.dtype if len(self.shapes[name]) >= 2 else "f32"

    def _tensor(self, name: str, gen_key: tuple, l: int, rows: Any, dtype: torch.dtype | None,
                device: Any) -> torch.Tensor:
        if name not in self.shapes:
            raise PlantedSpecError(f"{self}: no tensor {name!r} in a {self.config.arch} model "
                                   f"(ffn_act={self.config.ffn_act}, bias={self.config.bias})")
        shape, dev = self.shapes[name], torch.device(device)
        out_dt = dtype or _TORCH_DT[self.storage_dtype(name)]
        gen = self._gens.get(gen_key, _zeros)
        if len(shape) == 1:
            vec = gen(l, np.zeros(1, dtype=np.int64), dev)[0, : shape[0]]
            vec = vec if rows is None else vec[torch.as_tensor(_rows(rows), device=dev)]
            return vec.to(out_dt).contiguous()
        return _assemble(lambda blocks: gen(l, blocks, dev), shape, rows, out_dt, dev)

    def _generators(self) -> dict[tuple, Gen]:
        c = self.config
        g: dict[tuple, Gen] = {
            (K.TOKEN_EMBD, False): self._gen_embd,
            (K.ATTN_Q, False): self._gen_q, (K.ATTN_K, False): self._gen_k,
            (K.ATTN_V, False): self._gen_v, (K.ATTN_OUT, False): self._gen_o,
            (K.FFN_DOWN_T, False): self._gen_down, (K.FC1, False): self._gen_fc1,
            (K.FC2, False): self._gen_fc2, (K.OUTPUT, False): self._gen_output,
            (K.POS_EMBD, False): self._gen_pos,
            (K.OUTPUT_NORM, False): self._gen_output_norm,
        }
        if c.gated:
            g[(K.FFN_GATE, False)], g[(K.FFN_UP, False)] = self._gen_planted, self._gen_plain_up
        else:
            g[(K.FFN_UP, False)] = self._gen_planted
        ffn_norm = K.ATTN_NORM_2 if c.two_norms else (K.ATTN_NORM if c.parallel_attn else K.FFN_NORM)
        for tmpl in (K.ATTN_NORM, K.ATTN_NORM_2, K.FFN_NORM):
            g[(tmpl, False)] = self._gen_ffn_norm if tmpl == ffn_norm else _ones
        return g

    def _ints(self, what: tuple, l: int, blocks: np.ndarray, cols: int, bits: int, dev: torch.device) -> torch.Tensor:
        return block_ints(self.spec.seed, what + (l,), blocks, cols, bits, dev)

    # embeddings and heads -----------------------------------------------------------------------
    def _gen_embd(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """token_embd rows: rest dims with rms exactly 1, the bias channel at C_VALUE."""
        x = self._ints((K.TOKEN_EMBD,), 0, blocks, self.config.n_embd, 8, dev)  # [R, D]
        x[:, CHANNEL] = 0.0
        x.mul_((math.sqrt(self.config.n_embd - 1) / _row_norm(x).clamp_min(1.0)).float()[:, None])
        x[:, CHANNEL] = C_VALUE
        return x

    def _gen_pos(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.POS_EMBD,), 0, blocks, self.config.n_embd, 8, dev)
        x[:, CHANNEL] = 0.0
        return x.mul_(math.sqrt(POS_VAR / _VAR8))

    def _gen_output(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.OUTPUT,), 0, blocks, self.config.n_embd, 8, dev)
        return x.mul_(LOGIT_STD / math.sqrt(self.config.n_embd * _VAR8))

    def _gen_output_norm(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        # tied heads reuse the embedding (rows of norm sqrt(D)): scale the logits down to LOGIT_STD
        w = LOGIT_STD / math.sqrt(self.config.n_embd) if self.config.tied_output else 1.0
        return torch.full((1, self.config.n_embd), w, device=dev)

    def _gen_ffn_norm(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Norm feeding the FFN: 1, except the bias channel at r_ffn / C_VALUE (see module doc)."""
        w = torch.ones((1, self.config.n_embd), device=dev)
        w[0, CHANNEL] = self.plan(l).r_ffn / C_VALUE
        return w

    # attention -----------------------------------------------------------------------------------
    def _k_scale(self) -> float:
        # k = Wk y with y of unit per-dim variance: var(k_i) = D s^2 VAR8 = SELF_SCORE / sqrt(hd),
        # so the self score q_t . k_t / sqrt(hd) ~ SELF_SCORE and attention mostly stays on the
        # token itself: the attention output's variance is predictable (~ that of v)
        c = self.config
        return math.sqrt(SELF_SCORE / math.sqrt(c.head_dim) / (c.n_embd * _VAR8))

    def _gen_k(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.ATTN_K,), l, blocks, self.config.n_embd, 8, dev)
        x[:, CHANNEL] = 0.0
        return x.mul_(self._k_scale())

    def _gen_q(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """q row of head h, dim t = k row of h's KV group, dim t, plus small integer noise."""
        c, D = self.config, self.config.n_embd
        if c.n_gqa == 1:  # q row i pairs with k row i: the same blocks
            k = self._ints((K.ATTN_K,), l, blocks, D, 8, dev)
        else:
            rows = (blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1)  # [R]
            rows = np.minimum(rows, c.n_head * c.head_dim - 1)
            krows = (rows // c.head_dim) // c.n_gqa * c.head_dim + rows % c.head_dim
            k = _assemble(lambda b: self._ints((K.ATTN_K,), l, b, D, 8, dev),
                          (c.n_head_kv * c.head_dim, D), krows, torch.float32, dev)
        x = k.add_(self._ints((K.ATTN_Q,), l, blocks, D, 4, dev))
        x[:, CHANNEL] = 0.0
        return x.mul_(self._k_scale())

    def _gen_v(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.ATTN_V,), l, blocks, self.config.n_embd, 8, dev)
        x[:, CHANNEL] = 0.0
        return x.mul_(1.0 / math.sqrt(self.config.n_embd * _VAR8))  # v components ~ unit variance

    def _gen_o(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        c = self.config
        x = self._ints((K.ATTN_OUT,), l, blocks, c.n_head * c.head_dim, 8, dev)
        if blocks[0] == CHANNEL // BLOCK_ROWS:  # blocks are sorted: only the first can hold it
            x[CHANNEL % BLOCK_ROWS] = 0.0  # attention never writes the bias channel
        # attention output per dim: (H hd) unit-variance values * s^2 VAR8 = ATTN_VAR / L
        return x.mul_(math.sqrt(ATTN_VAR / self.full_layers / (c.n_head * c.head_dim * _VAR8)))

    # FFN -------------------------------------------------------------------------------------------
    def _bucket(self, l: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's CountSketch P [k, D]: (bucket [D] int64, sign [D] f32, bucket sizes [k])
        with balanced buckets over the rest dims; the bias channel's sign is 0. Cached."""
        if (l, dev) in self._sketch:
            return self._sketch[(l, dev)]
        D, k = self.config.n_embd, self.code_dim(l)
        keys = splitmix64(torch.tensor([stream_key(self.spec.seed, "sketch", l)]), 2 * D)[0]
        order = torch.from_numpy(np.argsort(keys[:D].numpy(), kind="stable"))  # [D]
        bucket = torch.empty(D, dtype=torch.int64)
        bucket[order] = torch.arange(D) % k
        sign = torch.where((keys[D:] & 1) == 1, 1.0, -1.0)
        bucket_rest = bucket.clone()
        bucket_rest[CHANNEL] = k  # a bucket of its own, dropped
        sign[CHANNEL] = 0.0
        sizes = torch.bincount(bucket_rest, minlength=k + 1)[:k].double()
        if len(self._sketch) > 8:
            self._sketch.clear()
        self._sketch[(l, dev)] = out = (bucket.to(dev), sign.to(dev), sizes.to(dev))
        return out

    def code_dim(self, l: int) -> int:
        """k: the predictor sees a k-dimensional sketch of the residual (fc1 = [P; -P; bias])."""
        return (self.config.predictor_ranks[l] - 1) // 2

    def _code(self, l: int, blocks: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """u [R, k] (odd ints in [-15, 15]) and |u P| [R] float64 for the rows of the blocks."""
        u = self._ints(("code",), l, blocks, self.code_dim(l), 4, dev)  # [R, k]
        _, _, sizes = self._bucket(l, dev)
        norm = ((u.double() ** 2) * sizes[None, :]).sum(dim=1).sqrt()  # |u P|^2 = sum_i u_i^2 |P_i|^2
        return u, norm

    def _row_vals(self, values: np.ndarray, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Per-row float64 values [n] -> [R] for the rows of the blocks (0 past the end)."""
        rows = (blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1)
        v = np.where(rows < len(values), values[np.minimum(rows, len(values) - 1)], 0.0)
        return torch.as_tensor(v, dtype=torch.float64, device=dev)

    def _gen_planted(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Gate (ReGLU) / up (ReLU) rows: rho a_j + sqrt(1 - rho^2) e_j, and m_j |g_j| on dim c."""
        rho, D = self.spec.rho, self.config.n_embd
        u, u_norm = self._code(l, blocks, dev)
        bucket, sign, _ = self._bucket(l, dev)
        # a = u P in one gather from [u, -u, 0]: column d reads u[bucket_d] signed (channel: 0)
        signed = bucket + torch.where(sign < 0, u.shape[1], 0) + torch.where(sign == 0, 2 * u.shape[1] - bucket, 0)
        a = torch.index_select(torch.cat((u, -u, torch.zeros_like(u[:, :1])), dim=1), 1, signed)  # [R, D]
        e = self._ints(("planted",), l, blocks, D, 8, dev)
        e[:, CHANNEL] = 0.0
        e_norm = _row_norm(e)
        cos = (a * e).sum(dim=1, dtype=torch.float64) / (u_norm * e_norm)  # exact integer dot
        ca, ce = rho / u_norm, math.sqrt(1 - rho * rho) / e_norm  # [R] float64
        g = e.mul_(ce.float()[:, None]).add_(a.mul_(ca.float()[:, None]))  # [R, D]
        g_norm = (rho**2 + (1 - rho**2) + 2 * rho * math.sqrt(1 - rho**2) * cos).sqrt()
        g[:, CHANNEL] = (self._row_vals(self.plan(l).m, blocks, dev) * g_norm).float()
        return g

    def _gen_plain_up(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """ReGLU's up rows: random, unit expected norm, blind to the bias channel."""
        x = self._ints((K.FFN_UP,), l, blocks, self.config.n_embd, 8, dev)
        x[:, CHANNEL] = 0.0
        return x.mul_(1.0 / math.sqrt((self.config.n_embd - 1) * _VAR8))

    def _gen_down(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """ffn_down_t rows [F, D]; for plain ReLU each block's mean output sum_j E[h_j] d_j is
        projected out (exact: E[h_j] on a 2^-20 grid times small ints sums exactly in fp64)."""
        plan, D = self.plan(l), self.config.n_embd
        d = self._ints((K.FFN_DOWN_T,), l, blocks, D, 8, dev)
        d[:, CHANNEL] = 0.0
        if self.config.gated:
            return d.mul_(plan.down_scale)
        e = self._row_vals(plan.relu_mean, blocks, dev).view(len(blocks), BLOCK_ROWS)  # [nb, B]
        d64 = d.double().view(len(blocks), BLOCK_ROWS, D)
        v = torch.einsum("nb,nbd->nd", e, d64)  # [nb, D] block mean direction (exact)
        coef = e / (e * e).sum(dim=1, keepdim=True).clamp_min(1e-300)  # [nb, B]
        d64 = d64 - coef[:, :, None] * v[:, None, :]
        return (d64 * plan.down_scale).float().view(-1, D)

    # predictor ---------------------------------------------------------------------------------
    def _gen_fc1(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """fc1 [r, D] = [P; -P; bias row; 0]: the bias row reads the channel scaled to r_ffn
        (minus the mean for LayerNorm models, whose norm subtracts it too)."""
        c, k, D = self.config, self.code_dim(l), self.config.n_embd
        r = c.predictor_ranks[l]
        bucket, sign, _ = self._bucket(l, dev)
        fc1 = torch.zeros((r, D), device=dev)
        fc1[bucket, torch.arange(D, device=dev)] = sign  # P (the channel's sign is 0)
        fc1[k: 2 * k] = -fc1[:k]
        bias = torch.full((D,), -1.0 / D if c.norm == "layer" else 0.0, device=dev)
        bias[CHANNEL] += 1.0
        fc1[2 * k] = bias * (self.plan(l).r_ffn / C_VALUE)
        idx = torch.as_tensor((blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1), device=dev)
        return fc1[idx.clamp_max(r - 1)]  # rows past r are trimmed by the caller

    def _gen_fc2(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """fc2 [F, r]: rho u_j / |u_j P| on the +P half, its negative on the -P half, and
        rho Phi^-1(q_j) on the bias row: logit_j = rho (a_j . x_rest + Phi^-1(q_j) r_ffn)."""
        rho, k, r = self.spec.rho, self.code_dim(l), self.config.predictor_ranks[l]
        u, u_norm = self._code(l, blocks, dev)
        w = u * (rho / u_norm).float()[:, None]  # [R, k]
        out = torch.zeros((u.shape[0], r), device=dev)
        out[:, :k], out[:, k: 2 * k] = w, -w
        out[:, 2 * k] = (rho * self._row_vals(self.plan(l).mq, blocks, dev)).float()
        return out


def _zeros(l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Biases (OPT's linear layers, LayerNorm's beta): all zero, so only the bias channel shifts."""
    return torch.zeros((len(blocks) * BLOCK_ROWS, 1), device=dev).expand(-1, 1 << 20)


def _ones(l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Norm weights that do not feed an FFN: all one."""
    return torch.ones((1, 1), device=dev).expand(1, 1 << 20)


def _name_index(cfg: ModelConfig, shapes: dict) -> dict[str, tuple[str, int | None, bool]]:
    """GGUF name -> (template, layer or None for model-level tensors, bias)."""
    index: dict[str, tuple[str, int | None, bool]] = {}
    for bias in (False, True):
        for tmpl in (K.TOKEN_EMBD, K.POS_EMBD, K.OUTPUT_NORM, K.OUTPUT):
            index[K.global_tensor(tmpl, bias)] = (tmpl, None, bias)
        for l in range(cfg.n_layer):
            for tmpl in K.LAYER_TENSORS:
                index[K.tensor(tmpl, l, bias)] = (tmpl, l, bias)
    return {n: v for n, v in index.items() if n in shapes}


def _rows(rows: Any) -> np.ndarray:
    if isinstance(rows, torch.Tensor):
        rows = rows.cpu().numpy()
    return np.asarray(rows, dtype=np.int64).reshape(-1)


def _assemble(gen: Callable[[np.ndarray], torch.Tensor], shape: tuple[int, ...], rows: Any,
              dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Rows of a [n, cols] tensor from its block generator: only the blocks holding the rows are
    generated, a few at a time (about 16 M elements per call)."""
    n, cols = shape
    want = np.arange(n) if rows is None else _rows(rows)
    if want.size and (want.min() < 0 or want.max() >= n):
        raise IndexError(f"rows out of range 0..{n - 1}: min {want.min()}, max {want.max()}")
    blocks = np.unique(want // BLOCK_ROWS)
    per_call = max(1, (1 << (26 if dev.type == "cuda" else 22)) // (BLOCK_ROWS * cols))
    out = torch.empty((len(want), cols), dtype=dtype, device=dev)
    for s in range(0, len(blocks), per_call):
        chunk = blocks[s: s + per_call]
        vals = gen(chunk)[:, :cols]  # [len(chunk) * B, cols]
        lo, hi = chunk[0] * BLOCK_ROWS, min(n, (chunk[-1] + 1) * BLOCK_ROWS)
        if rows is None:  # whole tensor: the chunk is a contiguous slice
            out[lo:hi].copy_(vals[: hi - lo])
            continue
        sel = np.nonzero((want >= lo) & (want < hi))[0]
        pos = np.searchsorted(chunk, want[sel] // BLOCK_ROWS) * BLOCK_ROWS + want[sel] % BLOCK_ROWS
        out[torch.as_tensor(sel, device=dev)] = vals[torch.as_tensor(pos, device=dev)].to(dtype)
    return out


def _fields(cfg: ModelConfig) -> dict[str, Any]:
    """GGUF metadata: the config, threshold 0 and a byte-level tokenizer padded to the vocab."""
    n_fill = cfg.n_vocab - BYTE_VOCAB_SIZE
    assert n_fill >= 0, f"vocab {cfg.n_vocab} smaller than the byte vocabulary {BYTE_VOCAB_SIZE}"
    fields = config_to_fields(cfg)
    fields.update(byte_level_fields(extra_tokens=[f"<filler{i}>" for i in range(n_fill)]))
    return fields


def planted_model(spec: str) -> PlantedModel:
    """The planted model of ``spec`` ("llama2-13b?dtype=f16&seed=0[&layers=N]")."""
    return PlantedModel(spec)


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------
def write_planted_gguf(spec: str | PlantedModel, path: str | Path, progress: bool = True,
                       stats_dir: str | Path | None = None, n_tokens: int = 1_000_000) -> Path:
    """Stream a planted model to a GGUF file (PWRI magic, predictors included), tensor by tensor,
    and its planted activation statistics to ``stats_dir`` (default ``<path stem>.activation/``)
    as upstream's ``activation_{l}.pt`` count tensors over ``n_tokens`` tokens."""
    model = spec if isinstance(spec, PlantedModel) else PlantedModel(spec)
    path = Path(path)
    tensors = {name: LazyTensor(shape, model.storage_dtype(name), _maker(model, name))
               for name, shape in model.shapes.items()}
    t0 = time.perf_counter()
    write_model(path, model.config, tensors, metadata=model.fields, sparse=True, progress=progress)
    if progress:
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    write_activation_stats(model, Path(stats_dir) if stats_dir else path.with_suffix(".activation"), n_tokens)
    return path


def _maker(model: PlantedModel, name: str) -> Callable[[], torch.Tensor]:
    return lambda: model.get(name)


def write_activation_stats(model: PlantedModel, folder: Path, n_tokens: int = 1_000_000) -> Path:
    """``folder/activation_{l}.pt``: 1-D int64 counts of each layer's neurons over n_tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    counts, _ = model.activation_counts(n_tokens)
    for l, c in enumerate(counts):
        torch.save(torch.from_numpy(c), folder / f"activation_{l}.pt")
    return folder
