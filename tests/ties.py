"""Decisions at a threshold, compared with rounding ties allowed (shared by tests/unit, tests/ray
and tests/serve).

A decision taken at a threshold (a neuron's pre-activation against zero, its predictor's logit
against the threshold, a greedy token against the runner-up) may go the other way on another
CPU where the compared value lies within rounding error of the threshold: the kernels' vector
width and FMA, torch's ISA and its threads sum in another order (``scripts/test.sh --portable``
runs the suite so). These helpers accept exactly those decisions, as ``quant_models.match_rounding``
does for logits, and fail on any other difference (tests/unit/test_ties.py plants such errors).

``assert_greedy``: every token is the reference's greedy choice or within ``tie`` of it, the
reference continuing along the tokens given. ``DecisionReference``: a predictor's or a SwiGLU's
decisions as ties that ``match_rounding`` flips. ``match_counts``: activation counts equal the
reference's once it has taken the other side of decisions within ``tie`` of their threshold
(and, for a ``KernelReference``, of the Q8_0 rounding ties of its activations). ``tie_mask``:
where a reference's activations are within rounding.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.reference import threshold_criterion

TIE = 1e-4  # relative margin under which a decision is a tie (quant_models.KernelReference.TIE's reasoning)


# --- greedy tokens --------------------------------------------------------------------------------
def assert_greedy(ref, prompt: Sequence[int], tokens: Sequence[int], tie: float = TIE, max_flips: int = 6,  # noqa: ANN001
                  adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> tuple[int, frozenset]:
    """Assert that ``tokens`` continue ``prompt`` greedily under ``ref`` (a ReferenceModel, or any
    object with ``forward(tokens, cache)`` -> logits [T, V] and ``new_cache()``): each is the
    reference's argmax, or within ``tie`` x max|logit| of it, the reference running along the
    tokens given. A reference with rounding ties (``ties``, ``flips``: quant_models.KernelReference)
    takes the other side of one where a step needs it, as ``match_rounding`` does, and keeps it
    for the later steps (up to ``max_flips``). ``adjust(logits, generated)``: the sampler's
    changes (penalties) before the argmax. Returns the steps that took a tie, and the flips."""
    flips, taken = frozenset(), 0
    for i, tok in enumerate(tokens):
        seq, done = list(prompt) + list(tokens[:i]), list(tokens[:i])
        gap, room = _gap(ref, seq, tok, flips, adjust, done)
        if gap > tie * room and hasattr(ref, "flips") and len(flips) < max_flips:
            for key in [k for _, k in sorted(set(ref.ties)) if k not in flips]:
                if _gap(ref, seq, tok, flips | {key}, adjust, done)[0] <= tie * room:
                    flips = flips | {key}
                    gap, room = _gap(ref, seq, tok, flips, adjust, done)
                    break
        if hasattr(ref, "flips"):
            ref.flips = frozenset()
        assert gap <= tie * room, (f"step {i}: token {tok} is {gap:.3g} below the reference's greedy token (a tie "
                                   f"is within {tie * room:.3g}; flips {sorted(flips)}); tokens {list(tokens)}")
        taken += gap > 0
    return taken, flips


def _gap(ref, seq: list[int], tok: int, flips: frozenset, adjust, done: list[int]) -> tuple[float, float]:  # noqa: ANN001
    """How far below the best the reference's logit of ``tok`` is after ``seq`` (adjusted for the
    tokens ``done`` so far), and max|logit| (ties are relative to it)."""
    if hasattr(ref, "flips"):
        ref.flips = flips
    logits = torch.as_tensor(ref.forward(seq, ref.new_cache())[-1]).double()
    if adjust is not None:
        logits = adjust(logits, done)
    return float(logits.max() - logits[tok]), float(logits.abs().max())


class FullForward:
    """A model run on the whole sequence at every step (HF transformers' causal LMs) as
    ``assert_greedy``'s reference: ``logits_of(ids)`` -> [T, V]."""

    def __init__(self, logits_of: Callable[[list[int]], torch.Tensor]) -> None:
        self.logits_of = logits_of

    def new_cache(self) -> list[int]:
        return []

    @torch.no_grad()
    def forward(self, tokens: list[int], cache: list[int]) -> torch.Tensor:
        cache.extend(tokens)
        return self.logits_of(list(cache))


# --- decisions ----------------------------------------------------------------------------------
def decision_margins(ref, l: int, pred_in: torch.Tensor, values: bool = False,  # noqa: ANN001
                     thresholds: Sequence[float] | None = None) -> torch.Tensor:
    """[T, F]: how far, relative to the size of its sums' rounding, each neuron's activity decision
    of layer ``l`` lies from its threshold: the sign of gate (reglu), up (relu), both (drelu); a
    thresholded SwiGLU's |SiLU(gate)| or |h| against t_l (inf: a dense SwiGLU decides nothing).
    ``values``: also how far each factor of h (gate, up) lies from zero, under which h itself is
    all rounding (a cancellation). ``thresholds``: a SwiGLU's, when ``ref`` runs without them."""
    x = ref.ffn_input(l, pred_in).double()
    pre = lambda tmpl: _pre(ref, l, x, tmpl)  # noqa: E731
    near_zero = lambda tmpls: [v.abs() / sc.clamp_min(1e-30) for v, sc in map(pre, tmpls)]  # noqa: E731
    if values:
        factors = [K.FFN_UP] + ([K.FFN_GATE] if ref.cfg.gated else [])
        return torch.stack([decision_margins(ref, l, pred_in, thresholds=thresholds)] + near_zero(factors)).amin(0)
    act = ref.cfg.ffn_act
    if act != "swiglu":
        return torch.stack(near_zero({"relu": [K.FFN_UP], "reglu": [K.FFN_GATE],
                                      "drelu": [K.FFN_GATE, K.FFN_UP]}[act])).amin(0)
    thresholds = ref.thresholds if thresholds is None else thresholds
    if thresholds is None:
        return torch.full((x.shape[0], ref.cfg.n_ff), torch.inf, dtype=torch.float64)
    (g, sg), (u, su) = pre(K.FFN_GATE), pre(K.FFN_UP)
    sig = torch.sigmoid(g)
    silu, dsilu = g * sig, (sig * (1 + g * (1 - sig))).abs()  # SiLU and its slope
    if ref.threshold_on == "gate":
        crit, err = silu.abs(), dsilu * sg
    else:
        crit, err = (silu * u).abs(), dsilu * sg * u.abs() + silu.abs() * su
    return (crit - thresholds[l]).abs() / err.clamp_min(1e-30)


def _pre(ref, l: int, x: torch.Tensor, tmpl: str) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """x [T, D] (float64) times the layer's ``tmpl`` rows (+ bias): the value and the size of its
    rounding, sum |x_i w_i| [T, F]."""
    w, b = (ref.w.get(K.tensor(tmpl, l, bias)) for bias in (False, True))
    w = w.double()
    v, sc = x @ w.T, x.abs() @ w.abs().T
    return (v, sc) if b is None else (v + b.double(), sc + b.double().abs())


def tie_mask(ref, windows: Sequence[Sequence[int]], values: bool = True, tie: float = TIE) -> np.ndarray:  # noqa: ANN001
    """[L, N, F] bool over the tokens of ``windows`` (each a forward of its own, rows in order):
    where a neuron's activity (``values``: or its activation) is within rounding, as
    ``decision_margins`` measures it."""
    out: list[list[torch.Tensor]] = [[] for _ in range(ref.cfg.n_layer)]

    class Hooks:
        def mask(self, l: int, pred_in: torch.Tensor) -> None:
            return None

        def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
            out[l].append(decision_margins(ref, l, pred_in, values) < tie)

    for w in windows:
        ref.forward(list(w), ref.new_cache(), Hooks())
    return np.stack([torch.cat(rows).numpy() for rows in out])


DECISIONS = ("predictor", "threshold", "active")


class DecisionReference:
    """A reference forward whose FFN keeps the neurons its decisions keep, a predictor's (fc1,
    fc2 [float64], threshold: logit >= threshold) and a thresholded SwiGLU's (|SiLU(gate)| or |h|
    above t_l), exposing the decisions within ``tie`` of their threshold as ``ties`` and taking
    those keyed in ``flips`` the other way, as quant_models.KernelReference does for its rounding
    ties: ``match_rounding`` and ``assert_greedy`` take it as their reference. Keys: (kind, row,
    layer, neuron), rows of one forward call; kind "predictor", "threshold", or "active" (a
    neuron's activation nonzero: counted, never fed back, for an activation within rounding of
    its threshold is within rounding of zero). A KernelReference underneath keeps its rounding
    ties beside them (its own keys). ``counts[kind]`` [L, F]: the tokens each decision kept in
    the last forward."""

    def __init__(self, ref, predictors: tuple | None = None, tie: float = TIE) -> None:  # noqa: ANN001
        self.ref, self.pred, self.tie, self.cfg = ref, predictors, tie, ref.cfg
        self.thresholds = ref.thresholds
        self.flips: frozenset = frozenset()
        self.ties: list[tuple[float, tuple]] = []
        self.counts: dict[str, np.ndarray] = {}

    def new_cache(self):  # noqa: ANN201
        return self.ref.new_cache()

    def forward(self, tokens, cache, hooks=None) -> torch.Tensor:  # noqa: ANN001
        assert hooks is None, "DecisionReference applies its own decisions"
        self.ties = []
        self.counts = {k: np.zeros((self.cfg.n_layer, self.cfg.n_ff), np.int64) for k in DECISIONS}
        rounding = hasattr(self.ref, "flips")
        if rounding:
            self.ref.flips = frozenset(k for k in self.flips if k[0] not in DECISIONS)
        self.ref.thresholds = None  # decided in mask(), where a decision can be flipped either way
        try:
            out = self.ref.forward(tokens, cache, self)
        finally:
            self.ref.thresholds = self.thresholds
            if rounding:
                self.ties += self.ref.ties
                self.ref.flips = frozenset()
        return out

    def mask(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(pred_in.shape[0], self.cfg.n_ff, dtype=torch.bool)
        if self.pred is not None:
            fc1, fc2, thr = self.pred
            x = pred_in.double()
            logit = torch.relu(x @ fc1[l].T) @ fc2[l].T  # [T, F]
            scale = (x.abs() @ fc1[l].abs().T) @ fc2[l].abs().T  # the size of the sums' rounding
            keep &= self._decide("predictor", l, logit >= thr, (logit - thr).abs() / scale.clamp_min(1e-30))
        if self.thresholds is not None:
            _, gate, h = self.ref.ffn_pre(l, self.ref.ffn_input(l, pred_in))
            crit = threshold_criterion(self.ref.threshold_on, gate, h)
            margin = decision_margins(self.ref, l, pred_in, thresholds=self.thresholds)
            keep &= self._decide("threshold", l, crit > self.thresholds[l], margin)
        self._keep = keep
        return keep

    def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        if self.thresholds is None:  # (a SwiGLU's activity is its threshold's decision)
            self._decide("active", l, (h != 0) & self._keep, decision_margins(self.ref, l, pred_in))

    def _decide(self, kind: str, l: int, active: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
        """active [T, F] with this kind's flipped decisions of layer l inverted; records ties."""
        active = active.clone()
        for k, row, fl, j in self.flips:
            if (k, fl) == (kind, l):
                active[row, j] = ~active[row, j]
        self.ties += [(float(margin[r, j]), (kind, r, l, j)) for r, j in (margin < self.tie).nonzero().tolist()]
        self.counts[kind][l] += active.sum(0).numpy()
        return active


def predictor_weights(mf, n_layer: int, threshold: float) -> tuple:  # noqa: ANN001
    """(fc1, fc2 [float64] per layer, threshold) of a ModelFile's predictors, for DecisionReference."""
    return ([mf.layer(K.FC1, l, dtype=torch.float64) for l in range(n_layer)],
            [mf.layer(K.FC2, l, dtype=torch.float64) for l in range(n_layer)], threshold)


# --- activation counts ----------------------------------------------------------------------------
def match_counts(ref, sequences: Sequence[Sequence[int]], got: np.ndarray, predictors: tuple | None = None,  # noqa: ANN001
                 tie: float = TIE, max_flips: int = 8) -> tuple[np.ndarray, frozenset]:
    """The reference's counts over ``sequences`` (each forward on its own; the predictor's
    decisions with ``predictors``, else the nonzero activations, as ``DecisionReference``
    counts them) closest to ``got`` [L, F]: while they differ, a tie is flipped (closest first:
    a decision of a neuron whose count differs, or a rounding tie of a KernelReference, which
    moves later decisions), and the first flip that brings the counts closer is kept, up to
    max_flips. Returns the counts and the flips ((call, key)); a difference no tie explains
    stays in the counts."""
    dref = DecisionReference(ref, predictors, tie)
    kind = "predictor" if predictors is not None else "threshold" if dref.thresholds is not None else "active"

    def run(flips: frozenset) -> tuple[np.ndarray, list]:
        counts, ties = np.zeros_like(got), []
        for s, seq in enumerate(sequences):
            dref.flips = frozenset(k for c, k in flips if c == s)
            dref.forward(list(seq), dref.new_cache())
            counts += dref.counts[kind]
            ties += [(m, (s, k)) for m, k in dref.ties if m < tie]
        return counts, sorted(ties)

    def explains(key: tuple, counts: np.ndarray) -> bool:  # a rounding tie, or a decision where counts differ
        _, k = key
        return k[0] not in DECISIONS or (k[0] == kind and got[k[2], k[3]] != counts[k[2], k[3]])

    flips = frozenset()
    counts, ties = run(flips)
    while (miss := int(np.abs(got - counts).sum())) and len(flips) < max_flips:
        for key in [k for _, k in ties if k not in flips and explains(k, counts)]:
            again, again_ties = run(flips | {key})
            if np.abs(got - again).sum() < miss:
                flips, counts, ties = flips | {key}, again, again_ties
                break
        else:
            break
    return counts, flips


def assert_counts(ref, sequences: Sequence[Sequence[int]], got: np.ndarray, predictors: tuple | None = None,  # noqa: ANN001
                  tie: float = TIE) -> np.ndarray:
    """Assert that counts ``got`` [L, F] are the reference's over ``sequences``, up to ties
    (``match_counts``); returns the reference's counts."""
    want, flips = match_counts(ref, sequences, got, predictors, tie)
    off = np.argwhere(got != want)
    assert not off.size, f"{len(off)} counts differ (ties taken: {sorted(flips)}): " + ", ".join(
        f"{tuple(i)}: {got[tuple(i)]} vs {want[tuple(i)]}" for i in off[:8])
    return want


def assert_same_up_to_ties(ref, prompt: Sequence[int], a: Sequence[int], b: Sequence[int], tie: float = TIE) -> None:  # noqa: ANN001
    """Two runs of the same request (alone and batched: sums split another way) agree token for
    token, or where they part both are greedy under ``ref`` up to ties (``assert_greedy``)."""
    if list(a) != list(b):
        assert_greedy(ref, prompt, a, tie)
        assert_greedy(ref, prompt, b, tie)


