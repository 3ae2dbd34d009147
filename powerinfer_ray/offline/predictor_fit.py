"""Training one layer's predictor: fc1 [r, D] -> ReLU -> fc2 [F, r], no biases (upstream's layout).

The predictor starts from the FFN's own selector: a neuron's activity is decided by the sign of
one linear function of the predictor input (ReGLU/dReLU/SwiGLU: the gate row; ReLU: the up row),
the norm's weight folded in (an RMS norm's scale does not change a sign). A rank-r/2 SVD of that
matrix M ~ U S V^T, written as fc1 = [V^T; -V^T], fc2 = [U S, -U S] (relu(v) - relu(-v) = v),
is a width-r predictor before any training (exact at r = 2 min(F, D)); weighted BCE then
improves it, so a few epochs suffice where a random start needs many.

The loss weighs an active neuron by pos_weight ((1 - p) / p, the class balance) times
(contribution / mean contribution) ** magnitude_power, so that the misses that remain are the
activations that matter least. The decision threshold is chosen afterwards (``thresholds``), so
training measures a predictor by the share of neurons it must keep to reach ``recall_target``
on held-out samples, and stops early when an epoch no longer improves it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as Fn

from ..model import gguf_keys as K
from ..model.config import ModelConfig
from ..model.reference import ReferenceModel
from .samples import LayerData, decode_magnitude

MIN_WIDTH = 16
WIDTH_STEP = 16  # widths are multiples of 16 (kernel-friendly)
INIT_LOGIT_STD = 4.0  # the SVD start's logits are scaled to this spread


@dataclass
class FitSettings:
    epochs: int = 3  # at most; early stopping may end sooner
    batch: int = 512
    lr: float = 1e-2
    magnitude_power: float = 0.5  # positive weight ~ (contribution / mean) ** power; 0: plain
    recall_target: float = 0.99  # training measures the kept share at this held-out recall
    min_improvement: float = 0.01  # stop when an epoch improves the kept share by less (relative)
    seed: int = 0


@dataclass
class LayerFit:
    """A trained predictor, weights rounded to the file's dtype, and its held-out measure."""

    width: int
    kept: float  # share of neurons kept at the recall target on held-out samples
    threshold: float  # the logit where that recall is reached
    epochs: int
    seconds: float
    fc1: torch.Tensor = field(repr=False)  # [r, D]
    fc2: torch.Tensor = field(repr=False)  # [F, r]
    history: list[float] = field(default_factory=list)  # kept share after each epoch


# ------------------------------------------------------------------------------------------------
# widths
# ------------------------------------------------------------------------------------------------
def layer_width(cfg: ModelConfig, model_bytes: int, max_width: int | None = None,
                max_share: float | None = None) -> int:
    """The predictor width of every layer: the widest multiple of 16 that keeps all predictors
    within ``max_share`` of ``model_bytes`` and within ``max_width``, and at most
    min(F / 2, 2 D) (wider buys nothing a dense gate would not)."""
    hi = min(cfg.n_ff // 2, 2 * cfg.n_embd)
    if max_width is not None:
        if max_width < MIN_WIDTH:
            raise ValueError(f"max_width is {max_width}, expected at least {MIN_WIDTH}")
        hi = min(hi, max_width)
    if max_share is not None:
        if not 0 < max_share < 1:
            raise ValueError(f"max_predictor_share is {max_share}, expected a share in (0, 1), e.g. 0.1")
        per_width = cfg.n_layer * cfg.dtype_bytes * (cfg.n_embd + cfg.n_ff)
        hi = min(hi, int(max_share * model_bytes / per_width))
        if hi < MIN_WIDTH:
            raise ValueError(f"max_predictor_share={max_share} allows width {hi} per layer, below the "
                             f"minimum {MIN_WIDTH}: raise it to at least "
                             f"{MIN_WIDTH * per_width / model_bytes:.4f}")
    return max(MIN_WIDTH, hi // WIDTH_STEP * WIDTH_STEP)


def predictor_bytes(cfg: ModelConfig, widths: list[int]) -> int:
    return sum(cfg.dtype_bytes * w * (cfg.n_embd + cfg.n_ff) for w in widths)


# ------------------------------------------------------------------------------------------------
# the start
# ------------------------------------------------------------------------------------------------
def selector_matrix(ref: ReferenceModel, l: int) -> torch.Tensor:
    """M [F, D]: the linear function of the predictor input whose sign decides each neuron
    (gate or up rows times the FFN norm's weight; centred for LayerNorm)."""
    cfg = ref.cfg
    w = ref.w[K.tensor(K.FFN_GATE if cfg.gated else K.FFN_UP, l)].float()  # [F, D]
    norm = K.FFN_NORM if not cfg.parallel_attn else (K.ATTN_NORM_2 if cfg.two_norms else K.ATTN_NORM)
    m = w * ref.w[K.tensor(norm, l)].float()[None, :]
    return m - m.mean(dim=1, keepdim=True) if cfg.norm == "layer" else m


def top_singular(m: torch.Tensor, r: int, dev: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(a [r, D], b [F, r]), float32 on the CPU, with a = V_r^T and b = U_r S_r of the top r singular
    triplets of m [F, D] (b @ a is its best rank-r approximation), from the eigenvectors of the
    smaller Gram matrix in float64 on ``dev`` (one [min(F, D)]^2 eigendecomposition, cheaper than
    a full SVD and run on the training device)."""
    F, D = m.shape
    m64 = m.to(dev, torch.float64)
    if D <= F:
        _, v = torch.linalg.eigh(m64.T @ m64)  # ascending
        v = v[:, D - r:].flip(1)  # [D, r]
        a, b = v.T, m64 @ v
    else:
        e, u = torch.linalg.eigh(m64 @ m64.T)
        u, s = u[:, F - r:].flip(1), e[F - r:].flip(0).clamp_min(0).sqrt()  # [F, r], [r]
        a, b = (u.T @ m64) / s.clamp_min(1e-30)[:, None], u * s
    return a.float().cpu(), b.float().cpu()


def svd_start(m: torch.Tensor, width: int, x: torch.Tensor, gen: torch.Generator,
              dev: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 [width, D], fc2 [F, width] computing the best rank-width/2 approximation of
    x -> M x (``top_singular`` on ``dev``), scaled so its logits on the sample inputs x [N, D] have
    spread INIT_LOGIT_STD; rows past 2 min(F, D) start small and random."""
    F, D = m.shape
    r = min(width // 2, F, D)
    a, b = top_singular(m, r, dev)  # [r, D], [F, r]
    spread = float((x.cpu().float() @ (b @ a).T).std().clamp_min(1e-12))
    fc1 = torch.cat([a, -a, torch.randn(width - 2 * r, D, generator=gen) * 0.01 / math.sqrt(D)])
    fc2 = torch.cat([b, -b, torch.zeros(F, width - 2 * r)], dim=1) * (INIT_LOGIT_STD / spread)
    return fc1, fc2


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------
def kept_at_recall(logits: torch.Tensor, code: torch.Tensor, recall: float) -> tuple[float, float]:
    """(share of neurons kept, threshold) for the highest threshold whose recall over
    logits/codes [N, F] reaches ``recall``."""
    pos = logits[code > 0]
    if pos.numel() == 0:
        return 0.0, float("inf")
    ranked = torch.sort(pos, descending=True).values
    t = float(ranked[min(math.ceil(recall * pos.numel()) - 1, pos.numel() - 1)])
    return float((logits >= t).float().mean()), t


def round_to_file(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """``t`` as the file stores it (f16/bf16 rounding), back in float32."""
    store = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}.get(dtype, torch.float16)
    return t.detach().to(store).float()


def fit_layer(data: LayerData, held: tuple[torch.Tensor, torch.Tensor], start: tuple[torch.Tensor, torch.Tensor],
              s: FitSettings, file_dtype: str, step: Callable[[], None] | None = None) -> LayerFit:
    """Train from ``start`` (fc1, fc2) on ``data``; after each epoch measure the kept share at
    ``s.recall_target`` on held (x [N, D], code [N, F]) with file-rounded weights; keep the best
    epoch and stop when one improves it by less than ``s.min_improvement``. ``step`` is called
    after every optimiser step (a progress bar)."""
    t0 = time.time()
    dev = data.device
    gen = torch.Generator().manual_seed(s.seed)
    rng = np.random.default_rng(s.seed)
    fc1, fc2 = (w.to(dev).clone().requires_grad_() for w in start)
    pos_weight = min(max((1 - data.active_share) / max(data.active_share, 1e-6), 1.0), 1e3)
    total = s.epochs * max(1, math.ceil(data.n / s.batch))
    opt = torch.optim.Adam([fc1, fc2], lr=s.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=s.lr, total_steps=total, pct_start=0.05,
                                                final_div_factor=20.0)
    best: tuple[float, float, torch.Tensor, torch.Tensor] | None = None
    history: list[float] = []
    for _ in range(s.epochs):
        for x, q in data.batches(s.batch, gen, rng):
            logits = torch.relu(x @ fc1.T) @ fc2.T  # [B, F]
            y = q > 0
            loss = Fn.binary_cross_entropy_with_logits(logits, y.float(), weight=_weights(q, y, pos_weight, data.mean_magnitude, s))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched.last_epoch < total - 1:
                sched.step()
            if step is not None:
                step()
        w1, w2 = round_to_file(fc1, file_dtype), round_to_file(fc2, file_dtype)
        with torch.no_grad():
            kept, t = kept_at_recall(torch.relu(held[0] @ w1.T) @ w2.T, held[1], s.recall_target)
        history.append(kept)
        if best is not None and kept > best[0] * (1 - s.min_improvement):
            if kept < best[0]:
                best = (kept, t, w1, w2)
            break
        best = (kept, t, w1, w2)
    assert best is not None
    kept, t, w1, w2 = best
    return LayerFit(int(w1.shape[0]), kept, t, len(history), time.time() - t0, w1.cpu(), w2.cpu(), history)


def _weights(q: torch.Tensor, y: torch.Tensor, pos_weight: float, mean_mag: float, s: FitSettings) -> torch.Tensor:
    """Per-element BCE weights [B, F]: 1 where inactive; where active pos_weight, times
    (contribution / mean contribution) ** magnitude_power, the ratio clipped to 1/20..20."""
    w = torch.full(q.shape, pos_weight, device=q.device)
    if s.magnitude_power:
        rel = (decode_magnitude(q) / max(mean_mag, 1e-30)).clamp(0.05, 20.0)
        w = w * rel.pow(s.magnitude_power)
    return torch.where(y, w, torch.ones_like(w))


def fit_summary(f: LayerFit) -> dict[str, Any]:
    return {"width": f.width, "kept_at_target": f.kept, "epochs": f.epochs, "seconds": round(f.seconds, 2),
            "history": [round(h, 5) for h in f.history]}
