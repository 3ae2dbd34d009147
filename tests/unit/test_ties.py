"""The tie-tolerant comparisons of tests/ties.py accept what another CPU's rounding can change
(a decision within ``tie`` of its threshold, the tokens and counts that follow from it) and catch
a planted error anywhere else."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_models import KernelReference, match_rounding
from ties import DecisionReference, assert_greedy, match_counts, predictor_weights

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model

SEQS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44]]


def _counts(ref, flips=frozenset(), tie=1e-4):  # noqa: ANN001, ANN202
    """DecisionReference's activity counts over SEQS with ``flips`` ((call, key)) taken the other
    way, and its ties [(margin, (call, key))]."""
    dref, counts, ties = DecisionReference(ref, tie=tie), 0, []
    for s, seq in enumerate(SEQS):
        dref.flips = frozenset(k for c, k in flips if c == s)
        dref.forward(seq, dref.new_cache())
        counts = counts + dref.counts["active"]
        ties += [(m, (s, k)) for m, k in dref.ties]
    return counts, ties


def test_a_flipped_decision_tie_is_explained_and_a_planted_count_is_not(tmp_path):
    """The closest decision of the reference taken the other way (as another CPU may take a tie) is
    explained by flipping it back; one more count at a neuron whose decisions are far from zero is not."""
    ref = ReferenceModel.from_file(write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=3, n_layer=2),
                                   dtype=torch.float64)
    plain, ties = _counts(ref, tie=1.0)
    margin, key = min(t for t in ties if t[1][1][0] == "active")  # the decision closest to its threshold
    tie = 2 * margin
    got = _counts(ref, flips=frozenset({key}), tie=tie)[0]
    assert np.abs(got - plain).sum() == 1
    want, flips = match_counts(ref, SEQS, got, tie=tie)
    assert np.array_equal(want, got) and len(flips) == 1
    safe = np.ones_like(got, dtype=bool)
    for _, (_, (_, _, l, j)) in _counts(ref, tie=tie)[1]:
        safe[l, j] = False
    l, j = np.argwhere(safe & (got < len(SEQS[0]) + len(SEQS[1])))[0]
    got[l, j] += 1  # a real error: no decision of this neuron is near its threshold
    want, _ = match_counts(ref, SEQS, got, tie=tie)
    assert int(np.abs(want - got).sum()) == 1 and want[l, j] == got[l, j] - 1


def test_a_rounding_tie_moves_later_counts_and_is_explained(tmp_path):
    """A KernelReference (Q8_0 model): an activation rounding tie taken the other way changes the
    counts of later decisions; match_counts finds a rounding tie that explains them. With no
    tie allowed (tie=0) the difference stays."""
    ref = KernelReference.from_file(write_tiny_model(tmp_path / "q.gguf", "llama-reglu", seed=1, n_layer=2,
                                                     n_embd=64, dtype="q8_0"))
    ref.TIE = 1e-2  # wide: some rounding decisions of these few tokens are within it
    plain, ties = _counts(ref, tie=0.0)  # the rounding ties only
    for _, key in sorted(ties):  # the first rounding tie whose other side changes a count
        got = _counts(ref, flips=frozenset({key}), tie=0.0)[0]
        if (got != plain).any():
            break
    else:
        pytest.fail("no rounding tie changes a count: widen ref.TIE")
    want, flips = match_counts(ref, SEQS, got, tie=1e-2)
    assert np.array_equal(want, got) and all(k[0] not in ("predictor", "threshold", "active") for _, k in flips)
    want, _ = match_counts(ref, SEQS, got, tie=0.0)
    assert not np.array_equal(want, got)


def test_greedy_tokens_allow_ties_only(tmp_path):
    ref = ReferenceModel.from_file(write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=3), dtype=torch.float64)
    prompt = [5, 6, 7]
    tokens = ref.generate_greedy(prompt, 6)
    assert assert_greedy(ref, prompt, tokens) == (0, frozenset())
    logits = ref.forward(prompt + tokens[:2], ref.new_cache())[-1]
    second = int(logits.argsort(descending=True)[1])  # the runner-up at step 2
    other = tokens[:2] + [second]
    gap = float(logits.max() - logits[second]) / float(logits.abs().max())
    with pytest.raises(AssertionError, match="step 2: token"):
        assert_greedy(ref, prompt, other)  # a real error: the runner-up is not within 1e-4
    assert assert_greedy(ref, prompt, other, tie=2 * gap)[0] == 1  # as if its gap were a tie


def test_a_flipped_predictor_decision_is_explained_and_a_planted_logit_error_is_not(tmp_path):
    """DecisionReference under match_rounding: logits of the reference with its closest predictor
    decision taken the other way (as another CPU may) are explained by that flip; an error of
    1 % of the largest logit is not."""
    from powerinfer_ray.model.gguf_file import ModelFile

    path = write_tiny_model(tmp_path / "p.gguf", "llama-reglu", seed=2, n_layer=2, predictor_rank=16)
    ref = ReferenceModel.from_file(path, dtype=torch.float64)
    tokens, at = list(range(30, 42)), [7, 11]
    wide = DecisionReference(ref, predictor_weights(ModelFile(path), 2, 0.5), tie=1.0)
    plain = wide.forward(tokens, wide.new_cache())
    for margin, key in sorted(wide.ties):  # the closest decision whose other side moves the logits
        wide.flips = frozenset({key})
        flipped = wide.forward(tokens, wide.new_cache())
        if max(float((flipped[i] - plain[i]).abs().max() / plain[i].abs().max()) for i in at) > 1e-4:
            break
    got = [flipped[i].numpy() for i in at]
    masked = DecisionReference(ref, predictor_weights(ModelFile(path), 2, 0.5), tie=2 * margin)
    errs, flips = match_rounding(masked, tokens, got, at)
    assert max(errs) < 1e-5 and flips == {key}
    got[1] = got[1] + 0.01 * np.abs(got[1]).max()
    errs, _ = match_rounding(masked, tokens, got, at)
    assert errs[1] > 1e-3
