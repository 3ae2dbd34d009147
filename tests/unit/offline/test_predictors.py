"""Predictor training: the SVD start, planted sparsity found, the quality knob, spilling samples
to Arrow shards with bounded memory, and the GGUF it writes."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import tiny_config, tiny_weights, write_tiny_model
from powerinfer_ray.model.tokenizer import byte_level_fields
from powerinfer_ray.offline.corpus import frozen_documents
from powerinfer_ray.offline.predictor_fit import (FitSettings, fit_layer, kept_at_recall, layer_width,
                                                  selector_matrix, svd_start, top_singular)
from powerinfer_ray.offline.predictors import train_predictors
from powerinfer_ray.offline.profile import profile_activations
from powerinfer_ray.offline.quality import PredictorHooks, quality_report
from powerinfer_ray.offline.samples import (LayerData, SampleStore, collect_samples, decode_magnitude,
                                            encode_magnitude)
from powerinfer_ray.offline.stream import StreamFormat, token_windows
from powerinfer_ray.offline.thresholds import QualityTarget
from powerinfer_ray.offline.train_tiny import trained_model_path

N_DEAD = 192  # of 256 neurons per layer: 75 % planted always-off
DOCS = frozen_documents("train")[:300]


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
    result = train_predictors(planted, DOCS, out, target=None, recall_target=0.95, max_tokens=6144,
                              heldout_tokens=1024, seq_len=64, settings=FitSettings(batch=128),
                              memory_cap=256 << 10, device="cpu", progress=False, log=lines.append)
    return result, lines


def test_svd_start_at_full_rank_is_the_gate(tmp_path):
    """Width 2 D holds the whole selector: the untrained start predicts ReGLU's mask exactly."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", n_ctx=64)
    ref = ReferenceModel.from_file(path)
    store = SampleStore(2, 64, 256)
    collect_samples(ref, token_windows_of(path, 256), store)
    x, q = (torch.from_numpy(a) for a in store.all(1))
    fc1, fc2 = svd_start(selector_matrix(ref, 1), 128, x, torch.Generator().manual_seed(0))
    logits = torch.relu(x @ fc1.T) @ fc2.T  # [N, F]
    gate = ref._norm(x, K.FFN_NORM, 1) @ ref.w[K.tensor(K.FFN_GATE, 1)].T  # [N, F]: active iff > 0
    differ = (logits > 0) != (q > 0)
    assert float((q > 0).float().mean()) > 0.2
    assert int(differ.sum()) == 0 or float(gate[differ].abs().max()) < 1e-4  # fp rounding at gate ~ 0 only
    narrow = svd_start(selector_matrix(ref, 1), 32, x, torch.Generator().manual_seed(0))
    assert not torch.equal(torch.relu(x @ narrow[0].T) @ narrow[1].T > 0, q > 0)  # rank 16 of 64: not exact


@pytest.mark.parametrize("shape", [(96, 40), (40, 96)])
def test_top_singular_is_the_best_rank_r_approximation(shape):
    """Against a float64 SVD: b @ a equals U_r S_r V_r^T, a's rows are orthonormal, b = m a^T."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(*shape, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(3, 0.1, shape[1], dtype=torch.float64))
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    for r in (5, 17, min(shape)):
        a, b = top_singular(m.float(), r)
        best = (u[:, :r] * s[:r]) @ vh[:r]
        assert a.shape == (r, shape[1]) and b.shape == (shape[0], r)
        assert torch.allclose((b @ a).double(), best, atol=1e-4 * float(s[0]))
        assert torch.allclose((a @ a.T).double(), torch.eye(r, dtype=torch.float64), atol=1e-4)
        assert torch.allclose(b.double(), m @ a.double().T, atol=1e-4 * float(s[0]))


def token_windows_of(path, n):
    from powerinfer_ray.model.tokenizer import Tokenizer

    return token_windows(Tokenizer(ModelFile(path).fields), DOCS[:20], 64, n)


def test_finds_planted_sparsity(planted, trained):
    result, _ = trained
    truth = profile_activations(planted, frozen_documents("heldout")[:60], max_tokens=2048, seq_len=64,
                                progress=False, device="cpu")
    F = truth.n_ff
    assert (truth.counts[:, F - N_DEAD:] == 0).all()  # the plant holds in the reference
    assert result.target == "recall 0.95" and result.target_met
    for l, r in enumerate(result.layers):
        # 0.95 on the dense forward's inputs; the report runs every layer sparse, which moves the
        # inputs of later layers a little
        assert r.recall >= 0.94, r
        assert r.active == pytest.approx(1 - truth.sparsity()[l], abs=0.03)
        assert r.kept < 1 - N_DEAD / F  # the dead quarter is skipped
        assert r.width % 16 == 0 and r.bytes == 4 * r.width * (64 + F)  # f32 model: f32 predictors
    hooks = PredictorHooks.from_file(result.path)
    ref = ReferenceModel.from_file(result.path)
    dead_kept = []

    class Watch(PredictorHooks):
        def mask(self, layer, x):
            m = super().mask(layer, x)
            dead_kept.append(float(m[:, F - N_DEAD:].float().mean()))
            return m

    ref.forward(next(token_windows_of(result.path, 64)), ref.new_cache(), Watch(hooks.fc1, hooks.fc2, hooks.threshold))
    assert max(dead_kept) < 0.02


def test_output_file(planted, trained):
    result, lines = trained
    src, out = ModelFile(planted), ModelFile(result.path)
    assert out.path.read_bytes()[:4] == K.PWRI_MAGIC
    assert out.config.sparse_threshold == pytest.approx(result.threshold, abs=1e-6)
    assert out.config.predictor_ranks == tuple(r.width for r in result.layers)
    for l, r in enumerate(result.layers):
        assert tuple(out.raw(K.tensor(K.FC1, l)).shape) == (r.width, 64)
        assert tuple(out.raw(K.tensor(K.FC2, l)).shape) == (256, r.width)
    for name in src.tensors:
        np.testing.assert_array_equal(np.asarray(out.raw(name)), np.asarray(src.raw(name)))
    assert out.fields[K.TOK_TOKENS] == src.fields[K.TOK_TOKENS]
    assert out.config.name == src.config.name
    assert result.predictor_bytes == sum(r.bytes for r in result.layers)
    assert "recall" in result.table() and any("training and" in line for line in lines)
    assert 0 < result.share_of_model <= 0.2  # the default cap
    assert all(r.ppl_increase is not None for r in result.layers)  # each layer's own cost


def test_kept_at_recall_hand_solved():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [2.5, -1.0, -2.0, -3.0]])
    code = torch.tensor([[9, 9, 0, 9], [9, 0, 0, 0]], dtype=torch.uint8)  # positives at 3, 2, 0, 2.5
    assert kept_at_recall(logits, code, 0.5) == (2 / 8, 2.5)  # 2 of 4 positives: logit >= 2.5
    assert kept_at_recall(logits, code, 0.75) == (3 / 8, 2.0)
    assert kept_at_recall(logits, code, 1.0) == (5 / 8, 0.0)  # the last positive drags in the 1.0


def test_layer_width_from_the_budget():
    cfg = tiny_config("llama-reglu", n_embd=64, n_ff=256, n_layer=2, dtype="f16")
    # a width-r predictor of this model costs 2 layers * 2 bytes * r * (64 + 256) = 1280 r bytes
    assert layer_width(cfg, model_bytes=10 ** 9) == 128  # min(F / 2, 2 D)
    assert layer_width(cfg, model_bytes=10 ** 9, max_width=100) == 96
    assert layer_width(cfg, model_bytes=640_000, max_share=0.1) == 48  # 64000 / 1280 = 50 -> 48
    with pytest.raises(ValueError, match="max_predictor_share=0.01 allows width 5"):
        layer_width(cfg, model_bytes=640_000, max_share=0.01)


def test_the_perplexity_limit_holds_on_the_heldout_text(tmp_path):
    """Asking for +1 % perplexity gives at most +1 % on that held-out text, as the written
    file's quality report measures it too."""
    out = tmp_path / "tiny.powerinfer.gguf"
    held = "builtin:pydoc:heldout"
    fmt = StreamFormat("bos", window_bos=False)  # windows of 128 stream tokens: the first 1024 are 8
    result = train_predictors(trained_model_path(), "builtin:stdlib:train", out, heldout=held,
                              target=QualityTarget(max_ppl_increase=0.01, min_top1=None), max_tokens=4096,
                              heldout_tokens=1024, seq_len=128, fmt=fmt, max_width=64,
                              settings=FitSettings(epochs=1), device="cpu", per_layer=False, progress=False,
                              log=lambda m: None)
    assert result.target_met and result.ppl_sparse <= 1.01 * result.ppl_dense
    assert result.ppl_sparse > result.ppl_dense  # the limit was used, not dodged by keeping everything
    r = quality_report(out, held, seq_len=128, max_tokens=1024, fmt=fmt, oracle=False)
    assert r["tokens"] == result.n_heldout_tokens
    assert r["ppl_ratio"] <= 1.01 and r["ppl_sparse"] == pytest.approx(result.ppl_sparse, rel=1e-4)
    assert r["sparsity"] == pytest.approx(result.sparsity, abs=1e-6) and r["sparsity"] > 0.5


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
    assert max(a.nbytes + b.nbytes for a, b in store.chunks(1)) <= 4096  # one chunk at a time, capped
    shards = list(store.shards[1])
    store.close()
    assert not any(p.exists() for p in shards)


def test_training_memory_does_not_grow_with_the_corpus(planted):
    """Collect and train one layer on 4x the tokens under the same cap: the peak of numpy
    memory (the samples) stays put, while the samples themselves grow 4x."""
    ref = ReferenceModel.from_file(planted)
    cap = 64 << 10
    peaks, sizes = [], []
    for n in (2048, 8192):
        tracemalloc.start()
        store = SampleStore(2, 64, 256, memory_cap=cap)
        collect_samples(ref, token_windows_of(planted, n), store)
        data = LayerData(store, 0, torch.device("cpu"))
        x0, q0 = next(store.chunks(0))
        start = svd_start(selector_matrix(ref, 0), 32, data.head(256), torch.Generator().manual_seed(0))
        fit_layer(data, (torch.from_numpy(x0[:256]), torch.from_numpy(q0[:256])), start,
                  FitSettings(epochs=1, batch=128), "f32")
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        sizes.append(sum(store.counts) * (64 * 4 + 256))
        store.close()
    assert sizes[1] == 4 * sizes[0] and sizes[1] > 8 * cap  # most of the samples went to disk
    assert peaks[1] < 1.3 * peaks[0], peaks


def test_magnitude_codes_round_trip():
    c = torch.tensor([[0.0, 1e-3, 0.5, 1.0, 7.0, 3e4]])
    q = encode_magnitude(c)
    assert q.dtype == torch.uint8 and int(q[0, 0]) == 0 and (q[0, 1:] > 0).all()
    back = decode_magnitude(q)
    assert float(back[0, 0]) == 0.0
    torch.testing.assert_close(back[0, 1:], c[0, 1:], rtol=0.05, atol=0)  # 8 steps per octave
