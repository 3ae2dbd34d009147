"""The trained tiny ReGLU model shipped as package data: file, tokenizer, skew, predictors,
and the quality of the predictor-driven sparse forward against dense (reference path)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.tokenizer import Tokenizer
from powerinfer_ray.offline.corpus import DATA_DIR, frozen_documents
from powerinfer_ray.offline.profile import ActivationStats, profile_activations
from powerinfer_ray.offline.quality import quality_report
from powerinfer_ray.offline.train_tiny import trained_model_path, trained_stats_path

TOKENS = 4096  # held-out tokens the checks run over (16 windows of 256)


@pytest.fixture(scope="module")
def model() -> ModelFile:
    return ModelFile(trained_model_path())


@pytest.fixture(scope="module")
def report() -> dict:
    return quality_report(trained_model_path(), "builtin:heldout", seq_len=256, max_tokens=TOKENS)


def test_file_and_config(model):
    c = model.config
    assert (c.arch, c.ffn_act, c.n_layer, c.n_embd, c.n_ff, c.n_vocab) == ("llama", "reglu", 6, 192, 768, 1024)
    assert c.dtype == "f16" and c.tied_output and -8.0 < c.sparse_threshold < 6.0  # chosen for a quality target
    assert (model.fields[K.STREAM_DOC_SEP], model.fields[K.STREAM_WINDOW_BOS]) == ("bos", False)  # as trained
    assert model.magic == K.PWRI_MAGIC and len(c.predictor_ranks) == 6
    dense = sum(t.data.size for n, t in model.tensors.items() if ".fc" not in n)
    assert 3.5e6 < dense < 5e6  # parameters without predictors
    assert model.path.stat().st_size <= 9.2e6
    assert sum(p.stat().st_size for p in DATA_DIR.iterdir() if p.is_file()) <= 12e6  # with tiny-swiglu.gguf


def test_default_model_is_the_trained_one():
    from powerinfer_ray.model.default import default_model_path

    assert default_model_path().resolve() == trained_model_path().resolve()


def test_tokenizer_round_trips_heldout_text(model):
    tok = Tokenizer(model.fields)
    assert tok.vocab_size == 1024 and (tok.bos_id, tok.eos_id) == (1022, 1023)
    docs = frozen_documents("heldout")[:40]
    for d in docs:
        assert tok.decode(tok.encode(d)) == d
    chars = sum(map(len, docs))
    assert chars / sum(len(tok.encode(d, add_bos=False)) for d in docs) > 2.0  # BPE merges do work


def test_profile_is_skewed():
    shipped = ActivationStats.load_parquet(trained_stats_path())
    assert shipped.n_tokens >= 100_000 and shipped.counts.shape == (6, 768)
    share = shipped.coverage_share(0.8)
    assert share.max() < 0.7 and share.mean() < 0.55  # uniform would be 0.80
    assert shipped.sparsity().mean() > 0.9
    fresh = profile_activations(trained_model_path(), "builtin:heldout", max_tokens=TOKENS, seq_len=256,
                                progress=False, device="cpu")
    assert fresh.coverage_share(0.8).mean() < 0.55
    np.testing.assert_allclose(fresh.active_fraction(), shipped.active_fraction(), rtol=0.35)


def test_predictors_reach_recall_on_heldout_tokens(report):
    for l, s in enumerate(report["layers"]):
        assert s["recall"] >= 0.95, (l, s)
        assert s["kept"] < 0.15, (l, s)  # and still skip most neurons
        assert s["precision"] > 0.2, (l, s)


def test_sparse_quality_against_dense(report):
    assert report["tokens"] == TOKENS - TOKENS // 256  # each window scores all but its first token
    assert report["top1_agreement"] >= 0.98, report["top1_agreement"]
    assert report["ppl_sparse"] <= 1.02 * report["ppl_dense"], (report["ppl_sparse"], report["ppl_dense"])
    assert report["ppl_dense"] < 25  # a language model, not noise (uniform: 1024); all held-out: ~12.7


def test_oracle_mask_equals_dense(report):
    assert report["oracle_max_abs_logit_diff"] < 1e-4
    assert report["oracle_top1_agreement"] == 1.0
    assert math.isclose(report["ppl_oracle"], report["ppl_dense"], rel_tol=1e-6)
