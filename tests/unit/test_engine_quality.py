"""The hybrid runtime with the trained tiny model's own predictors agrees with dense as often as
the offline quality report says (same windows, same predictor decisions)."""
from __future__ import annotations

import numpy as np
import pytest

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
                                   prefill_chunk=8, threshold=mf.config.sparse_threshold - margin))
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
