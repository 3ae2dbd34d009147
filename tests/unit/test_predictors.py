"""Predictor training: planted sparsity found, spilling to Arrow shards, the GGUF it writes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import tiny_config, tiny_weights
from powerinfer_ray.model.tokenizer import byte_level_fields
from powerinfer_ray.offline.corpus import frozen_documents
from powerinfer_ray.offline.predictors import (FitSettings, PredictorHooks, SampleStore, Trial, choose,
                                               decode_magnitude, encode_magnitude, train_predictors)
from powerinfer_ray.offline.profile import profile_activations

N_DEAD = 192  # of 256 neurons per layer: 75 % planted always-off


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A seeded tiny ReGLU model whose gate rows N_DEAD.. are zero: those neurons never fire."""
    cfg = tiny_config("llama-reglu", n_ctx=64)
    w = tiny_weights(cfg, seed=3)
    for l in range(cfg.n_layer):
        w[K.tensor(K.FFN_GATE, l)][cfg.n_ff - N_DEAD:] = 0.0
    path = tmp_path_factory.mktemp("planted") / "planted.gguf"
    return write_model(path, cfg, w, metadata=byte_level_fields())


@pytest.fixture(scope="module")
def trained(planted, tmp_path_factory):
    out = tmp_path_factory.mktemp("pred") / "planted.powerinfer.gguf"
    lines: list[str] = []
    result = train_predictors(planted, frozen_documents("train")[:300], out, recall_target=0.95,
                              max_tokens=6144, seq_len=64, settings=FitSettings(batch=128, epochs=12),
                              memory_cap=256 << 10, device="cpu", progress=False, log=lines.append)
    return result, lines


def test_finds_planted_sparsity(planted, trained):
    result, _ = trained
    truth = profile_activations(planted, frozen_documents("heldout")[:60], max_tokens=2048, seq_len=64,
                                progress=False, device="cpu")
    F = truth.n_ff
    assert (truth.counts[:, F - N_DEAD:] == 0).all()  # the plant holds in the reference
    for l, r in enumerate(result.layers):
        assert r.recall >= 0.95, r
        assert r.true_sparsity == pytest.approx(truth.sparsity()[l], abs=0.03)
        assert r.true_sparsity > N_DEAD / F
        assert r.pred_sparsity >= N_DEAD / F - 0.02, r  # dead neurons are (nearly) never predicted
        assert r.width % 16 == 0 and r.bytes == 4 * r.width * (64 + F)  # f32 model: f32 predictors
    # on unseen text: the predictors skip the dead neurons and keep the live ones they should
    hooks = PredictorHooks.from_file(result.path)
    ref = ReferenceModel.from_file(result.path)
    from powerinfer_ray.model.tokenizer import Tokenizer

    tok = Tokenizer(ModelFile(result.path).fields)
    dead_kept = []

    class Watch(PredictorHooks):
        def mask(self, layer, x):
            m = super().mask(layer, x)
            dead_kept.append(float(m[:, F - N_DEAD:].float().mean()))
            return m

    watch = Watch(hooks.fc1, hooks.fc2, hooks.threshold)
    ids = tok.encode(" ".join(frozen_documents("heldout")[60:70]))[:64]
    ref.forward(ids, ref.new_cache(), watch)
    stats = watch.stats(F)
    assert max(dead_kept) < 0.02
    assert min(s["recall"] for s in stats) >= 0.85  # one window: a noisy, but not a weak, check


def test_output_file(planted, trained):
    result, lines = trained
    src, out = ModelFile(planted), ModelFile(result.path)
    assert out.path.read_bytes()[:4] == K.PWRI_MAGIC
    assert out.config.sparse_threshold == 0.0
    assert out.config.predictor_ranks == tuple(r.width for r in result.layers)
    for l, r in enumerate(result.layers):
        assert tuple(out.raw(K.tensor(K.FC1, l)).shape) == (r.width, 64)
        assert tuple(out.raw(K.tensor(K.FC2, l)).shape) == (256, r.width)
    for name in src.tensors:
        np.testing.assert_array_equal(np.asarray(out.raw(name)), np.asarray(src.raw(name)))
    assert out.fields[K.TOK_TOKENS] == src.fields[K.TOK_TOKENS]
    assert out.config.name == src.config.name
    assert result.predictor_bytes == sum(r.bytes for r in result.layers)
    assert "recall" in result.table() and any("width" in line for line in lines)
    assert 0 < result.share_of_model < 1


def test_sample_store_spills_and_reads_back(tmp_path):
    store = SampleStore(n_layer=2, n_embd=8, n_ff=20, memory_cap=4096, spill_dir=tmp_path / "spill")
    g = torch.Generator().manual_seed(0)
    xs, ms = [], []
    for _ in range(6):
        x, m = torch.randn(37, 8, generator=g), torch.rand(37, 20, generator=g) > 0.7
        xs.append(x), ms.append(m)
        store.add(1, x, m)
    assert store.spilled(1) and not store.spilled(0)
    assert all(p.suffix == ".arrow" for p in store.shards[1])
    x, q = store.all(1)
    np.testing.assert_array_equal(x, torch.cat(xs).numpy())
    np.testing.assert_array_equal(q > 0, torch.cat(ms).numpy())
    np.testing.assert_array_equal(store.active[1], torch.cat(ms).sum(0).numpy())
    shards = list(store.shards[1])
    store.close()
    assert not any(p.exists() for p in shards)


def test_magnitude_codes_round_trip():
    c = torch.tensor([[0.0, 1e-3, 0.5, 1.0, 7.0, 3e4]])
    q = encode_magnitude(c)
    assert q.dtype == torch.uint8 and int(q[0, 0]) == 0 and (q[0, 1:] > 0).all()
    back = decode_magnitude(q)
    assert float(back[0, 0]) == 0.0
    torch.testing.assert_close(back[0, 1:], c[0, 1:], rtol=0.05, atol=0)  # 8 steps per octave


def _trial(width, recall, pred_sparsity):
    z = torch.zeros(1)
    return Trial(width, recall, 0.5, pred_sparsity, 0.9, 1.0, 0, 0.0, z, z)


def test_choose_prefers_small_widths_but_not_at_any_sparsity():
    # recall alone is the wrong objective: the narrow width "meets" it by keeping everything
    trials = [_trial(16, 0.99, 0.10), _trial(32, 0.96, 0.80), _trial(64, 0.97, 0.81)]
    assert choose(trials, 0.95, 0.05).width == 32
    assert choose([_trial(16, 0.90, 0.9), _trial(32, 0.93, 0.9)], 0.95, 0.05).width == 32  # none meets
