"""Decisions at a threshold, compared with rounding ties allowed (shared by tests/unit, tests/ray
and tests/serve).

A decision taken at a threshold (a neuron's pre-activation against zero, its predictor's logit
against the threshold, a greedy token against the runner-up) may go the other way on another
CPU where the compared value lies within rounding error of the threshold: the kernels' vector
width and FMA, torch's ISA and its threads sum in another order (``scripts/test.sh --portable``
runs the suite so). These helpers accept exactly those decisions, as ``quant_models.match_rounding``
does for logits, and fail on any other difference (tests/unit/test_ties.py plants such errors).

``assert_greedy``: every token is the reference's greedy choice or within ``tie`` of it, the
reference continuing along the tokens given. ``match_counts``: activation counts equal the
reference's once it has taken the other side of decisions within ``tie`` of their threshold
(and, for a ``KernelReference``, of the Q8_0 rounding ties of its activations).
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


# --- activation counts ----------------------------------------------------------------------------
def decision_margins(ref, l: int, pred_in: torch.Tensor, values: bool = False,  # noqa: ANN001
                     thresholds: Sequence[float] | None = None) -> torch.Tensor:
    """[T, F]: how far, relative to the size of its sums' rounding, each neuron's activity decision
    of layer ``l`` lies from its threshold: the sign of gate (reglu), up (relu), both (drelu); a
    thresholded SwiGLU's |SiLU(gate)| or |h| against t_l (inf: a dense SwiGLU decides nothing).
    ``values``: also how far each factor of h (gate, up) lies from zero, under which h itself is
    all rounding (a cancellation). ``thresholds``: a SwiGLU's, when ``ref`` runs without them."""
    if values:
        factors = [K.FFN_UP] + ([K.FFN_GATE] if ref.cfg.gated else [])
        x = ref.ffn_input(l, pred_in).double()
        sums = [_pre(ref, l, x, t) for t in factors]
        return torch.stack([decision_margins(ref, l, pred_in, thresholds=thresholds)]
                           + [v.abs() / sc.clamp_min(1e-30) for v, sc in sums]).amin(0)
    x = ref.ffn_input(l, pred_in).double()

    pre = lambda tmpl: _pre(ref, l, x, tmpl)  # noqa: E731
    act = ref.cfg.ffn_act
    if act != "swiglu":
        sums = [pre(t) for t in {"relu": [K.FFN_UP], "reglu": [K.FFN_GATE], "drelu": [K.FFN_GATE, K.FFN_UP]}[act]]
        return torch.stack([v.abs() / sc.clamp_min(1e-30) for v, sc in sums]).amin(0)
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


class TieCounts:
    """FFNHooks counting, per layer and neuron, the tokens whose activation is nonzero; with
    predictors (fc1, fc2 [float64], threshold) the predictor's decisions instead, which then
    also mask the FFN, as the engine's do. Each decision's relative margin from its threshold
    (``decision_margins``) goes to ``ties`` when under ``tie``; decisions keyed in ``flips``
    ((call, layer, row, neuron), ``call`` set by the caller per forward) are taken the other way."""

    def __init__(self, ref, predictors: tuple | None = None, flips: frozenset = frozenset(),  # noqa: ANN001
                 tie: float = TIE) -> None:
        cfg = ref.cfg
        self.ref, self.pred, self.flips, self.tie = ref, predictors, flips, tie
        self.counts = np.zeros((cfg.n_layer, cfg.n_ff), np.int64)
        self.ties: list[tuple[float, tuple]] = []
        self.call = 0

    def mask(self, l: int, pred_in: torch.Tensor) -> torch.Tensor | None:
        if self.pred is None:
            return None
        fc1, fc2, thr = self.pred
        x = pred_in.double()
        logit = torch.relu(x @ fc1[l].T) @ fc2[l].T  # [T, F]
        scale = (x.abs() @ fc1[l].abs().T) @ fc2[l].abs().T  # [T, F]: the size of the sums' rounding
        m = self._decide(l, logit >= thr, (logit - thr).abs() / scale.clamp_min(1e-30))
        self.counts[l] += m.sum(0).numpy()
        return m

    def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        if self.pred is None:
            self.counts[l] += self._decide(l, h != 0, decision_margins(self.ref, l, pred_in)).sum(0).numpy()

    def _decide(self, l: int, active: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
        """active [T, F] with the flipped decisions of this call and layer inverted; records ties."""
        active = active.clone()
        for c, fl, row, j in self.flips:
            if (c, fl) == (self.call, l):
                active[row, j] = ~active[row, j]
        for row, j in (margin < self.tie).nonzero().tolist():
            self.ties.append((float(margin[row, j]), (self.call, l, row, j)))
        return active


def match_counts(ref, sequences: Sequence[Sequence[int]], got: np.ndarray, predictors: tuple | None = None,  # noqa: ANN001
                 tie: float = TIE, max_flips: int = 8) -> tuple[np.ndarray, frozenset]:
    """The reference's counts over ``sequences`` (each forward on its own, TieCounts' hooks)
    closest to ``got`` [L, F]: while they differ, a tie is flipped (closest first: a decision of a
    neuron whose count differs, or a rounding tie of a KernelReference, which moves its later
    decisions), and the first flip that brings the counts closer is kept, up to max_flips.
    Returns the counts and the flips; a difference no tie explains stays in the counts."""
    def run(flips: frozenset) -> tuple[np.ndarray, list]:
        hooks = TieCounts(ref, predictors, frozenset(k[1:] for k in flips if k[0] == "decide"), tie)
        rounding = []
        for s, seq in enumerate(sequences):
            hooks.call = s
            if hasattr(ref, "flips"):  # a KernelReference: its rounding ties, keyed per forward
                ref.flips = frozenset(k[2:] for k in flips if k[:2] == ("round", s))
            ref.forward(list(seq), ref.new_cache(), hooks)
            rounding += [(m, ("round", s, *key)) for m, key in set(getattr(ref, "ties", ())) if m < tie]
        if hasattr(ref, "flips"):
            ref.flips = frozenset()
        return hooks.counts, sorted(rounding + [(m, ("decide", *key)) for m, key in hooks.ties])

    flips = frozenset()
    counts, ties = run(flips)
    while (miss := int(np.abs(got - counts).sum())) and len(flips) < max_flips:
        candidates = [key for _, key in ties if key not in flips
                      and (key[0] == "round" or got[key[2], key[4]] != counts[key[2], key[4]])]
        for key in candidates:
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


# --- decisions that mask the FFN ----------------------------------------------------------------
DECISIONS = ("predictor", "threshold")


class DecisionReference:
    """A reference forward whose FFN keeps the neurons its decisions keep, a predictor's (fc1,
    fc2 [float64], threshold: logit >= threshold) and a thresholded SwiGLU's (|SiLU(gate)| or |h|
    above t_l), exposing the decisions within ``tie`` of their threshold as ``ties`` and taking
    those keyed in ``flips`` the other way, as quant_models.KernelReference does for its rounding
    ties: ``match_rounding`` and ``assert_greedy`` take it as their reference. Keys: (kind, row,
    layer, neuron), kind "predictor" or "threshold", rows of one forward call; a KernelReference
    underneath keeps its rounding ties beside them (its own keys). ``pairs``: the (token, neuron)
    pairs the last forward kept, ``decided``: those each kind kept."""

    def __init__(self, ref, predictors: tuple | None = None, tie: float = TIE) -> None:  # noqa: ANN001
        self.ref, self.pred, self.tie, self.cfg = ref, predictors, tie, ref.cfg
        self.thresholds = ref.thresholds
        self.flips: frozenset = frozenset()
        self.ties: list[tuple[float, tuple]] = []
        self.pairs, self.decided = 0, {}

    def new_cache(self):  # noqa: ANN201
        return self.ref.new_cache()

    def forward(self, tokens, cache, hooks=None) -> torch.Tensor:  # noqa: ANN001
        assert hooks is None, "DecisionReference applies its own decisions"
        self.ties, self.pairs, self.decided = [], 0, dict.fromkeys(DECISIONS, 0)
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
            scale = (x.abs() @ fc1[l].abs().T) @ fc2[l].abs().T
            keep &= self._decide("predictor", l, logit >= thr, (logit - thr).abs() / scale.clamp_min(1e-30))
        if self.thresholds is not None:
            _, gate, h = self.ref.ffn_pre(l, self.ref.ffn_input(l, pred_in))
            crit = threshold_criterion(self.ref.threshold_on, gate, h)
            margin = decision_margins(self.ref, l, pred_in, thresholds=self.thresholds)
            keep &= self._decide("threshold", l, crit > self.thresholds[l], margin)
        self.pairs += int(keep.sum())
        return keep

    def observe(self, l: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        pass

    def _decide(self, kind: str, l: int, active: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
        active = active.clone()
        for k, row, fl, j in self.flips:
            if (k, fl) == (kind, l):
                active[row, j] = ~active[row, j]
        self.ties += [(float(margin[r, j]), (kind, r, l, j)) for r, j in (margin < self.tie).nonzero().tolist()]
        self.decided[kind] += int(active.sum())
        return active


def predictor_weights(mf, n_layer: int, threshold: float) -> tuple:  # noqa: ANN001
    """(fc1, fc2 [float64] per layer, threshold) of a ModelFile's predictors, for TieCounts and
    DecisionReference."""
    return ([mf.layer(K.FC1, l, dtype=torch.float64) for l in range(n_layer)],
            [mf.layer(K.FC2, l, dtype=torch.float64) for l in range(n_layer)], threshold)
