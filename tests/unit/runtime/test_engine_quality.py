"""The hybrid runtime with the trained tiny model's own predictors agrees with dense as often as
the offline quality report says (same windows, same predictor decisions)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer_ray.model.default import default_model_path
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tokenizer import Tokenizer
from powerinfer_ray.offline.corpus import iter_texts
from powerinfer_ray.offline.stream import token_windows
from powerinfer_ray.offline.quality import quality_report
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine

SEQ, MAX = 64, 128


@pytest.mark.parametrize("margin", [0.0, 1.5])
def test_runtime_top1_agreement_matches_the_quality_report(margin):
    """At the file's threshold and at a serve-time margin (the runtime's threshold lowered by
    it): the margin the quality report measures is the one the engine applies."""
    path = default_model_path()
    report = quality_report(path, "builtin:heldout", seq_len=SEQ, max_tokens=MAX, oracle=False, margin=margin)
    mf = ModelFile(path)
    ref = ReferenceModel.from_file(mf)
    tok = Tokenizer(mf.fields)
    eng = LocalEngine(EngineConfig(str(path), gpu_fraction=0.3, policy="predictor", max_batch=1,
                                   prefill_chunk=8, predictor_margin=margin))
    agree = n = 0
    try:
        for window in token_windows(tok, iter_texts("builtin:heldout"), SEQ, MAX):
            inp = window[:-1]  # the positions the report scores
            dense = ref.forward(inp, ref.new_cache()).argmax(-1).numpy()
            got = [int(np.argmax(eng.primary.step([0], [[t]], [i])[0])) for i, t in enumerate(inp)]
            agree += int((dense == np.array(got)).sum())
            n += len(inp)
        assert eng.cpu is not None and eng.cpu.stats.neurons > 0  # the CPU shard took part
        assert 0 < eng.cpu.stats.kernel_s <= eng.cpu.stats.busy_s  # its kernel time, within its answers'
    finally:
        eng.close()
    assert n == report["tokens"]
    # the same windows and predictor decisions: equal up to a token flipped by fp rounding (the
    # >= 98 % bar itself is checked on 4096 tokens in test_trained_model)
    assert abs(agree / n - report["top1_agreement"]) <= 1.0 / n + 1e-9, (agree / n, report["top1_agreement"])


def test_serve_time_margin_trades_sparsity_for_quality_monotonically():
    """--predictor-margin m decides at the file's threshold minus m: a larger margin computes
    more neurons and lands closer to dense (KL against the float reference, one held-out
    window); far below every logit it computes all of them and equals dense."""
    path = default_model_path()
    mf = ModelFile(path)
    ref = ReferenceModel.from_file(mf)
    window = next(iter(token_windows(Tokenizer(mf.fields), iter_texts("builtin:heldout"), SEQ, SEQ)))[:-1]
    dense = torch.log_softmax(ref.forward(window, ref.new_cache()).double(), -1)
    neurons, kls = [], []
    for margin in (-1.0, 0.0, 1.5, 4.0, 1e4):
        eng = LocalEngine(EngineConfig(str(path), gpu_fraction=0.3, policy="predictor", max_batch=1,
                                       prefill_chunk=8, predictor_margin=margin))
        try:
            got = torch.tensor(np.stack([eng.primary.step([0], [[t]], [i])[0] for i, t in enumerate(window)]))
            st = eng.primary.stats, eng.cpu.stats
            neurons.append(st[0].neurons + st[1].neurons)
        finally:
            eng.close()
        lp = torch.log_softmax(got.double(), -1)
        kls.append(float((dense.exp() * (dense - lp)).sum(-1).mean()))
    total = len(window) * mf.config.n_layer * mf.config.n_ff
    assert neurons == sorted(neurons) and len(set(neurons)) == len(neurons), neurons
    assert neurons[-1] == total  # every neuron of every layer, every token
    assert kls == sorted(kls, reverse=True), kls
    assert kls[-1] < 1e-6 < kls[1]  # dense at the top; the file's threshold drops some mass
