"""Activation profiling: counts against the reference, corpus readers, Parquet and upstream .pt
round trips (layer files sorted numerically), coverage share and the plot."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.offline.corpus import iter_texts
from powerinfer_ray.offline.stream import token_windows
from powerinfer_ray.offline.profile import (ActivationStats, ActivationStatsError, profile_activations,
                                            run_profile)

DOCS = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7} times, "
        f"while the {('red', 'green', 'blue')[i % 3]} cat sleeps." for i in range(40)]


def fake_stats(n_layer: int = 12, n_ff: int = 32, seed: int = 0) -> ActivationStats:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, size=(n_layer, n_ff))
    counts[:, 0] = np.arange(n_layer) * 10 + 1000  # neuron 0 tells the layers apart
    return ActivationStats(counts, n_tokens=2000, model="fake")


def test_parquet_round_trip(tmp_path):
    stats = fake_stats()
    path = stats.save_parquet(tmp_path / "a.parquet")
    table = pq.read_table(path)
    assert table.schema.field("layer").type == pa.int32()
    assert table.schema.field("neuron").type == pa.int32()
    assert table.schema.field("count").type == pa.int64()
    assert table.schema.metadata[b"n_tokens"] == b"2000" and table.schema.metadata[b"model"] == b"fake"
    back = ActivationStats.load_parquet(path)
    assert back.n_tokens == 2000 and back.model == "fake"
    np.testing.assert_array_equal(back.counts, stats.counts)


def test_pt_round_trip_sorts_layers_numerically(tmp_path):
    stats = fake_stats(n_layer=12)
    folder = stats.save_pt(tmp_path / "activation")
    names = sorted(p.name for p in folder.glob("activation_*.pt"))
    assert names[:3] == ["activation_0.pt", "activation_1.pt", "activation_10.pt"]  # lexicographic trap
    back = ActivationStats.load_pt(folder)
    np.testing.assert_array_equal(back.counts, stats.counts)
    assert back.counts[10, 0] == 1100 and back.counts[9, 0] == 1090
    assert back.n_tokens == 2000
    # upstream writes no meta.json: n_tokens comes from the caller
    (folder / "meta.json").unlink()
    up = ActivationStats.load_pt(folder, n_tokens=5000)
    assert up.n_tokens == 5000
    np.testing.assert_array_equal(up.counts, stats.counts)
    # each file is a plain 1-D tensor that weights_only loading accepts
    t = torch.load(folder / "activation_11.pt", weights_only=True)
    assert t.ndim == 1 and t.dtype == torch.int64 and int(t[0]) == 1110


def test_pt_missing_layer_is_an_error(tmp_path):
    folder = fake_stats(n_layer=3).save_pt(tmp_path / "act")
    (folder / "activation_1.pt").unlink()
    with pytest.raises(ActivationStatsError, match="activation_0.pt .. activation_2.pt"):
        ActivationStats.load_pt(folder)


def test_coverage_share():
    uniform = ActivationStats(np.full((1, 100), 10), n_tokens=100)
    assert uniform.coverage_share(0.8)[0] == pytest.approx(0.8)
    skewed = np.ones((1, 100), dtype=np.int64)
    skewed[0, :5] = 1000  # 5 hot neurons carry 98 % of activations: 5 % of neurons
    assert ActivationStats(skewed, n_tokens=1000).coverage_share(0.8)[0] == pytest.approx(0.05)


def test_counts_match_a_direct_count(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", n_ctx=64)
    ref = ReferenceModel.from_file(path)
    stats = profile_activations(ref, DOCS, max_tokens=256, seq_len=64, progress=False,
                                tokenizer=_byte_tokenizer(path))
    assert stats.n_tokens == 256
    # recount through the FFN pieces themselves: h != 0 for relu(gate) * up
    expect = torch.zeros_like(torch.from_numpy(stats.counts))

    class Count:
        def mask(self, l, x):
            return None

        def observe(self, l, x, h):
            expect[l] += ((torch.relu(ref.ffn_gate_of(l, x)) * ref.ffn_up_of(l, x)) != 0).sum(0)

    tok = _byte_tokenizer(path)
    ref.ffn_gate_of = lambda l, x: ref._norm(x, K.FFN_NORM, l) @ ref._t(K.FFN_GATE, l).T
    ref.ffn_up_of = lambda l, x: ref._norm(x, K.FFN_NORM, l) @ ref._t(K.FFN_UP, l).T
    for w in token_windows(tok, DOCS, 64, 256):
        ref.forward(w, ref.new_cache(), Count())
    np.testing.assert_array_equal(stats.counts, expect.numpy())
    assert 0.3 < stats.sparsity().mean() < 0.7  # random ReGLU: about half the gates are negative


def _byte_tokenizer(path):
    from powerinfer_ray.model.gguf_file import ModelFile
    from powerinfer_ray.model.tokenizer import Tokenizer

    return Tokenizer(ModelFile(path).fields)


def test_corpus_formats_give_the_same_profile(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama-relu", n_ctx=64)
    (tmp_path / "c.txt").write_text("\n\n".join(DOCS) + "\n")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "c.parquet")
    (tmp_path / "docs").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(d)
    assert list(iter_texts(tmp_path / "c.txt")) == ["\n\n".join(DOCS) + "\n"]  # a text file is one document
    for corpus in ("c.jsonl", "c.parquet", "docs"):
        assert list(iter_texts(tmp_path / corpus)) == DOCS
    stats = [profile_activations(path, tmp_path / c, max_tokens=512, seq_len=64, progress=False)
             for c in ("docs", "c.jsonl", "c.parquet")]
    for s in stats[1:]:
        np.testing.assert_array_equal(s.counts, stats[0].counts)
    assert stats[0].n_tokens == 512


def test_bad_corpus_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="string field 'text'"):
        list(iter_texts(tmp_path / "bad.jsonl"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="text column 'text'"):
        list(iter_texts(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match="no such file"):
        list(iter_texts(tmp_path / "missing.txt"))


def test_run_profile_writes_everything(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", n_ctx=64)
    lines = []
    stats = run_profile(path, DOCS, tmp_path / "prof", max_tokens=256, seq_len=64, progress=False,
                        log=lines.append)
    assert (tmp_path / "prof" / "activation.parquet").exists()
    assert sorted(p.name for p in (tmp_path / "prof" / "activation").glob("*.pt")) == \
        ["activation_0.pt", "activation_1.pt"]
    png = tmp_path / "prof" / "rank_frequency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    assert "neurons for 80%" in lines[1]
    back = ActivationStats.load_parquet(tmp_path / "prof" / "activation.parquet")
    np.testing.assert_array_equal(back.counts, stats.counts)
