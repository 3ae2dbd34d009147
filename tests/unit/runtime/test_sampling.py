"""The sampler against a float64 reference of the distribution it draws from: softmax(logits /
temperature) over the top_k most likely tokens, then the nucleus (the sorted prefix whose mass
before each token stays under top_p), renormalized."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer_ray.runtime import sampling
from powerinfer_ray.runtime.sampling import SamplingParams, make_generator, sample


def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution [V] (float64) sample() draws from."""
    x = logits.astype(np.float64) / p.temperature
    order = np.argsort(-x, kind="stable")
    if p.top_k and p.top_k < len(x):
        order = order[:p.top_k]
    probs = np.exp(x[order] - x[order].max())
    probs /= probs.sum()
    keep = np.cumsum(probs) - probs < p.top_p
    out = np.zeros(len(x))
    out[order[keep]] = probs[keep] / probs[keep].sum()
    return out


CASES = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.6),
         dict(temperature=1.5, top_k=12, top_p=0.8), dict(temperature=1.0, top_p=1e-6)]


@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("first, bins", [(256, 1024), (1, 1024), (1, 3)],
                         ids=["nucleus-in-top", "nucleus-wider", "nucleus-wider-coarse-bins"])
def test_draws_follow_the_reference_distribution(kw, first, bins, monkeypatch):
    """4000 seeded draws over 40 tokens (two of them masked, -inf): never outside the reference's
    support, each token's frequency within 4.5 standard deviations of its probability; the same
    seed gives the same draws. first: how many tokens the nucleus is looked for in (then 16 times
    as many) before the histogram; bins: the histogram's (3: the bin where the nucleus ends holds
    many tokens)."""
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", first)
    monkeypatch.setattr(sampling, "NUCLEUS_BINS", bins)
    logits = np.random.default_rng(3).normal(0, 1.5, 40).astype(np.float32)
    logits[[7, 29]] = -np.inf
    p = SamplingParams(**kw)
    want = reference(logits, p)
    gen, n = make_generator(11), 4000
    draws = np.array([sample(logits, p, gen) for _ in range(n)])
    assert want[draws].min() > 0, "a token outside the top-k / nucleus was drawn"
    freq = np.bincount(draws, minlength=len(want)) / n
    bound = 4.5 * np.sqrt(want * (1 - want) / n) + 1e-9
    assert (np.abs(freq - want) <= bound).all(), (freq - want, bound)
    again = make_generator(11)
    assert [sample(logits, p, again) for _ in range(50)] == draws[:50].tolist()


def test_greedy_and_penalties():
    """Temperature 0 is the argmax of the penalized logits: a frequency penalty on the top token
    hands the choice to the next, as x - 1.5 * count says (float64 by hand)."""
    logits = np.array([0.0, 3.0, 2.5, -1.0], dtype=np.float32)
    gen = make_generator(0)
    assert sample(logits, SamplingParams(), gen) == 1
    counts = torch.tensor([0, 1, 0, 0], dtype=torch.float32)
    assert sample(logits, SamplingParams(frequency_penalty=1.5), gen, counts) == 2  # 3 - 1.5 < 2.5
    assert sample(logits, SamplingParams(frequency_penalty=0.4), gen, counts) == 1  # 3 - 0.4 > 2.5


@pytest.mark.parametrize("bins", [3, 1024])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_a_wide_nucleus_is_the_reference_set(bins, top_p, monkeypatch):
    """Over 5000 tokens, a nucleus wider than the first look (the histogram's path) holds exactly
    the tokens of the float64 reference's sorted prefix, except a token whose mass before it is
    within rounding of top_p (a tie either way may take); its weights are the tokens' own."""
    monkeypatch.setattr(sampling, "NUCLEUS_BINS", bins)
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", 2)
    x = np.random.default_rng(5).normal(0, 2.0, 5000).astype(np.float32)
    z = (x.max() - x).astype(np.float32)
    w = np.exp(-z)
    kept_w, kept = sampling._nucleus(x, w, top_p, 1.0)
    assert len(kept) > 16 * sampling.NUCLEUS_FIRST  # the histogram's path
    p = np.exp(-z.astype(np.float64))
    p /= p.sum()
    order = np.argsort(z, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    want = set(order[before < top_p].tolist())
    tie = set(order[np.abs(before - top_p) < 1e-6].tolist())
    assert set(kept.tolist()) ^ want <= tie
    np.testing.assert_array_equal(kept_w, w[kept])
