"""The decision threshold, chosen for a quality target on held-out text.

Every layer's predictor is trained the same way (weighted BCE, so its logits are weighted
log-odds of activity), and one threshold for all layers is the rule the file, the runtime and
upstream PowerInfer read (``powerinfer.sparse_threshold``). Per-layer thresholds that miss an
equal share of each layer's activation count did no better, and of its activation mass worse
(bench/results/predictor-quality-tiny-allocation.json), so there is one.

``choose_threshold`` bisects the threshold with sparse forwards of the held-out windows until
the perplexity increase and top-1 agreement against dense meet the target: the highest
threshold, hence the sparsest model, that does. A serve-time margin m moves it to ``t - m``:
more neurons for m > 0, fewer for m < 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .quality import Evaluator, PredictorHooks, Score

THRESHOLD_RANGE = (-8.0, 6.0)  # logits: far below it every neuron runs, far above none does
SEARCH_STEPS = 8  # brackets the threshold within (14 / 2^8) ~ 0.05 logits


@dataclass(frozen=True)
class QualityTarget:
    """What the held-out text must show against dense: perplexity at most ``max_ppl_increase``
    (a fraction: 0.01 is +1 %) above dense, top-1 agreement at least ``min_top1``."""

    max_ppl_increase: float | None = 0.005
    min_top1: float | None = 0.99

    def __post_init__(self) -> None:
        if self.max_ppl_increase is not None and not 0 <= self.max_ppl_increase < 1:
            raise ValueError(f"max_ppl_increase is {self.max_ppl_increase}, expected a fraction in [0, 1) "
                             "(0.01 or '1%' for +1 %)")
        if self.min_top1 is not None and not 0 < self.min_top1 <= 1:
            raise ValueError(f"min_top1 is {self.min_top1}, expected a fraction in (0, 1], e.g. 0.99")

    def met(self, s: Score, dense: Score) -> bool:
        ok = self.max_ppl_increase is None or s.ppl <= dense.ppl * (1 + self.max_ppl_increase)
        return ok and (self.min_top1 is None or s.top1 >= self.min_top1)

    def describe(self) -> str:
        parts = []
        if self.max_ppl_increase is not None:
            parts.append(f"perplexity <= dense +{100 * self.max_ppl_increase:g} %")
        if self.min_top1 is not None:
            parts.append(f"top-1 >= {100 * self.min_top1:g} %")
        return " and ".join(parts) or "none"


def parse_fraction(text: str | float, name: str) -> float:
    """'1%' -> 0.01, '0.01' -> 0.01; a ValueError naming ``name`` otherwise."""
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected a fraction (0.01) or a percentage (1%)") from None


def quality_target(max_ppl_increase: str | None, min_top1: str | None) -> QualityTarget | None:
    """The target of the command-line flags (percentages or fractions). Neither given: the
    default target; one given: that limit alone; 'none' drops a limit (None when none is left)."""
    if max_ppl_increase is None and min_top1 is None:
        return QualityTarget()

    def one(v: str | None, name: str) -> float | None:
        return None if v is None or v.lower() == "none" else parse_fraction(v, name)

    ppl, top1 = one(max_ppl_increase, "max_ppl_increase"), one(min_top1, "min_top1")
    return None if ppl is None and top1 is None else QualityTarget(ppl, top1)


@dataclass
class Calibration:
    threshold: float
    score: Score
    target: QualityTarget
    met: bool
    trials: list[dict[str, float]] = field(default_factory=list)


def choose_threshold(ev: Evaluator, fc1: list[torch.Tensor], fc2: list[torch.Tensor], target: QualityTarget,
                     log: Callable[[str], None] | None = None) -> Calibration:
    """The highest threshold whose sparse forward over the evaluator's windows meets
    ``target`` (the lowest of THRESHOLD_RANGE when none does)."""
    trials: list[dict[str, float]] = []

    def trial(t: float) -> Score:
        s = ev.score(PredictorHooks(fc1, fc2, t))
        met = target.met(s, ev.dense)
        trials.append({"threshold": t, "ppl_increase": s.ppl / ev.dense.ppl - 1, "top1": s.top1, "met": met})
        if log is not None:
            log(f"  threshold {t:+.3f}: perplexity {100 * (s.ppl / ev.dense.ppl - 1):+.3f} %, top-1 "
                f"{100 * s.top1:.2f} %{'' if met else '  (misses the target)'}")
        return s

    lo, hi = THRESHOLD_RANGE
    s_lo = trial(lo)
    if not target.met(s_lo, ev.dense):
        return Calibration(lo, s_lo, target, False, trials)
    best = (lo, s_lo)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        s = trial(mid)
        if target.met(s, ev.dense):
            lo, best = mid, (mid, s)
        else:
            hi = mid
    return Calibration(best[0], best[1], target, True, trials)


def per_layer_quality(ev: Evaluator, fc1: list[torch.Tensor], fc2: list[torch.Tensor],
                      threshold: float) -> list[dict[str, float]]:
    """Per layer: perplexity increase and top-1 agreement with only that layer sparse."""
    out = []
    for l in range(len(fc1)):
        s = ev.score(PredictorHooks(fc1, fc2, threshold, layers=[l]))
        out.append({"layer": l, "ppl_increase": s.ppl / ev.dense.ppl - 1, "top1": s.top1})
    return out
