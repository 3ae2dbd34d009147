"""Benchmarks from files (bench/planted_file.py): a planted model written once to a GGUF file named
by its spec, read back bit for bit, not rewritten when it matches, and run by the engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ties import assert_greedy

from powerinfer_ray.bench import load_driver
from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.planted import planted_model
from powerinfer_ray.offline.solve import load_counts


@pytest.fixture(scope="module")
def pf():
    return load_driver("planted_file")


def test_file_names_keep_the_shape(pf):
    assert pf.file_name("llama2-13b?dtype=f16") == "llama2-13b-f16.gguf"
    assert pf.file_name("planted:falcon-40b?dtype=f16&seed=0") == "falcon-40b-f16.gguf"  # defaults dropped
    assert pf.file_name("llama2-7b?layers=2&seed=3") == "llama2-7b-f16-seed3-layers2.gguf"
    assert pf.file_name("llama2-13b?ranges=2&dtype=f16") == "llama2-13b-f16-ranges2.gguf"  # another model
    assert pf.canonical("llama2-7b?layers=2&seed=3&dtype=f16") == "llama2-7b?dtype=f16&seed=3&layers=2"
    with pytest.raises(ValueError, match="unknown option 'size'"):
        pf.file_name("llama2-7b?size=3")


def test_planted_file_holds_the_planted_model_and_is_written_once(pf, tmp_path):
    spec = "tiny?layers=2&dtype=f16"
    path = pf.planted_file(spec, tmp_path, device="cpu", progress=False)
    assert path == tmp_path / "tiny-f16-layers2.gguf" and not list(tmp_path.glob("*.partial"))
    f, m = ModelFile(path), planted_model(spec)
    assert f.meta(K.PLANTED_SPEC) == "tiny?dtype=f16&layers=2" and f.config.n_layer == 2
    assert set(f.tensors) == set(m.shapes)
    for name in m.shapes:
        want = m.get(name)
        got = f.get(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    counts, n_tokens = load_counts(tmp_path / "tiny-f16-layers2.activation.parquet")
    want_counts, want_tokens = m.activation_counts(pf.N_TOKENS)
    assert n_tokens == want_tokens and all(np.array_equal(a, b) for a, b in zip(counts, want_counts))
    assert (tmp_path / "tiny-f16-layers2.activation" / "activation_1.pt").exists()  # upstream's format too
    stamp = path.stat().st_mtime_ns
    assert pf.planted_file("planted:tiny?dtype=f16&layers=2", tmp_path, device="cpu", progress=False) == path
    assert path.stat().st_mtime_ns == stamp  # matched: not written again
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut short: written again
    pf.planted_file(spec, tmp_path, device="cpu", progress=False)
    assert path.read_bytes() == data


def test_an_engine_from_the_planted_file_generates_as_the_planted_model(pf, tmp_path):
    """The CPU executor computes in place in the file; the greedy tokens are the planted model's
    dense reference's."""
    from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine

    spec = "tiny?layers=2&dtype=f32"
    path = pf.planted_file(spec, tmp_path, device="cpu", progress=False)
    prompt = list(range(5, 25))
    eng = LocalEngine(EngineConfig(str(path), gpu_fraction=0.5, policy="oracle", max_batch=1, prefill_chunk=32))
    try:
        assert eng.cpu.ffn_rows == "file"
        logits, out = eng.primary.step([0], [prompt], [0])[0], []
        for i in range(6):
            out.append(int(np.argmax(logits)))
            logits = eng.primary.step([0], [[out[-1]]], [len(prompt) + i])[0]
    finally:
        eng.close()
    assert_greedy(planted_model(spec).reference(), prompt, out)
