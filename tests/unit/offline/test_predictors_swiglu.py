"""train-predictors on a sparsified SwiGLU model learns the thresholded mask: its truth is the
neurons above the thresholds (half of them at target sparsity 0.5, not SiLU's almost-never-zero
h), and the written file keeps the thresholds beside the predictors (the predicted mode, on request)."""
from __future__ import annotations

import pytest
from swiglu_models import sparsified

from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.offline.predictors import train_predictors
from powerinfer_ray.runtime.config import EngineConfig, resolve_policy


@pytest.mark.parametrize("target", [0.3, 0.5])
def test_predictors_of_a_sparsified_model_learn_its_thresholded_mask(tmp_path, target):
    sparse = sparsified(tmp_path / "sparse.gguf", target)
    res = train_predictors(sparse, "builtin:train", tmp_path / "pred.gguf", target=None, recall_target=0.95,
                           max_tokens=2048, heldout_tokens=512, seq_len=128, device="cpu", progress=False,
                           per_layer=False, log=lambda s: None)
    for r in res.layers:  # held-out text: the truth is the thresholded mask
        assert abs(r.active - (1 - target)) < 0.05, r
        assert r.recall >= 0.95, r
    mf = ModelFile(res.path)
    assert mf.config.has_predictors and mf.config.ffn_thresholds == ModelFile(sparse).config.ffn_thresholds
    # the predicted mode runs when asked (gate-first stays the default of a gate-thresholded model)
    assert resolve_policy(EngineConfig(str(res.path), policy="predictor"), mf.config) == "predictor"
