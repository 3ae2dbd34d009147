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

from typing import Sequence

import numpy as np
import torch

from powerinfer_ray.model import gguf_keys as K

TIE = 1e-4  # relative margin under which a decision is a tie (quant_models.KernelReference.TIE's reasoning)


# --- greedy tokens --------------------------------------------------------------------------------
def assert_greedy(ref, prompt: Sequence[int], tokens: Sequence[int], tie: float = TIE) -> int:  # noqa: ANN001
    """Assert that ``tokens`` continue ``prompt`` greedily under ``ref`` (a ReferenceModel, or any
    object with ``forward(tokens, cache)`` -> logits [T, V] and ``new_cache()``): each is the
    reference's argmax, or within ``tie`` x max|logit| of it. Returns the steps that took a tie."""
    cache = ref.new_cache()
    logits = ref.forward(list(prompt), cache)[-1]
    taken = 0
    for i, tok in enumerate(tokens):
        lg = torch.as_tensor(logits).double()
        best = int(lg.argmax())
        gap = float(lg[best] - lg[tok])
        assert gap <= tie * float(lg.abs().max()), (
            f"step {i}: token {tok} is {gap:.3g} below the reference's greedy token {best} "
            f"(a tie is within {tie * float(lg.abs().max()):.3g}); tokens {list(tokens)}")
        taken += tok != best
        logits = ref.forward([tok], cache)[-1]
    return taken


# --- activation counts ----------------------------------------------------------------------------
class TieCounts:
    """FFNHooks counting, per layer and neuron, the tokens whose activation is nonzero (the ReLU
    family: relu, reglu, drelu); with predictors (fc1, fc2 [float64], threshold) the predictor's
    decisions instead, which then also mask the FFN, as the engine's do. Each decision's relative
    margin from its threshold goes to ``ties`` when under ``tie``; decisions keyed in ``flips``
    ((call, layer, row, neuron), ``call`` set by the caller per forward) are taken the other way."""

    def __init__(self, ref, predictors: tuple | None = None, flips: frozenset = frozenset(),  # noqa: ANN001
                 tie: float = TIE) -> None:
        cfg = ref.cfg
        assert cfg.ffn_act in ("relu", "reglu", "drelu"), f"TieCounts: {cfg.ffn_act} has no zero threshold"
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
        if self.pred is not None:
            return
        x = self.ref.ffn_input(l, pred_in).double()
        margins = [(x @ w.T + (0 if b is None else b)).abs() / (x.abs() @ w.abs().T + (0 if b is None else b.abs()))
                   for w, b in self._gating(l)]  # [T, F] each: the pre-activations compared with zero
        self.counts[l] += self._decide(l, h != 0, torch.stack(margins).amin(0)).sum(0).numpy()

    def _gating(self, l: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of the projections whose sign decides activity: gate (reglu), up (relu),
        both (drelu)."""
        def w(tmpl: str, bias: bool = False) -> torch.Tensor | None:
            t = self.ref.w.get(K.tensor(tmpl, l, bias))
            return None if t is None else t.double()

        act = self.ref.cfg.ffn_act
        return [(w(t), w(t, True)) for t in {"relu": [K.FFN_UP], "reglu": [K.FFN_GATE],
                                             "drelu": [K.FFN_GATE, K.FFN_UP]}[act]]

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
