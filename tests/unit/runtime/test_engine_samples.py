"""Predictor samples through the engine (runtime/engine_samples.py): on a split with neurons on
both executors, every step dense on the primary, the store receives what the dense reference
gives it on the same windows, in the same order: the predictor inputs within fp32 rounding, the
activation codes equal but for a rounding step and for activations within rounding; and
``train-predictors --engine`` trains predictors as good as the reference path's."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from powerinfer_ray import cli
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.offline.predictors import train_predictors
from powerinfer_ray.offline.samples import SampleStore, collect_samples, decode_magnitude
from powerinfer_ray.offline.train_tiny import trained_model_path
from powerinfer_ray.runtime.config import EngineConfig
from powerinfer_ray.runtime.engine import LocalEngine
from powerinfer_ray.runtime.engine_samples import collect_with_engine, engine_collector
from powerinfer_ray.runtime.plan import Plan
from ties import tie_mask


def _mixed(cfg, seed: int = 0) -> Plan:
    """About 40 % of each layer's neurons and half of its KV-head groups on the primary."""
    rng = np.random.default_rng(seed)
    groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return Plan.from_masks([rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)], groups, cfg)


def _windows(n_vocab: int, n: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_vocab, size=(n, seq_len)).tolist()


def _store(cfg) -> SampleStore:
    return SampleStore(cfg.n_layer, cfg.n_embd, cfg.n_ff)


def _both(ref, path, windows: list[list[int]], mixed: bool = True, **engine) -> tuple[SampleStore, SampleStore]:
    """(the engine's samples, the reference's) of ``windows`` on the CPU; ``mixed``: a plan with
    neurons on both executors, else every neuron on the primary; engine: its options."""
    want, got = _store(ref.cfg), _store(ref.cfg)
    collect_samples(ref, windows, want)
    ec = EngineConfig(str(path), plan=_mixed(ref.cfg) if mixed else None, device="cpu", **engine)
    assert collect_with_engine(ec, windows, len(windows[0]), got) == len(windows) * len(windows[0])
    return got, want


def assert_same_samples(got: SampleStore, want: SampleStore, ref, windows: list[list[int]],  # noqa: ANN001
                        ties: float = 0.0) -> None:
    """Every layer: the same rows in the same order; x within fp32 rounding; contributions' codes
    equal to a step (8 per octave), but where the reference's activation is within rounding (a
    decision within rounding of its threshold, or a factor of h within rounding of zero:
    ``ties.tie_mask``), which may go the other way. ``ties``: the share of contributions that
    may differ beyond that (x then within 1e-2 of its largest)."""
    n_tokens = sum(len(w) for w in windows)
    rounding = tie_mask(ref, windows)  # [L, N, F]
    for l in range(got.n_layer):
        (gx, gq), (wx, wq) = got.all(l), want.all(l)
        assert gx.shape == wx.shape == (n_tokens, got.D) and gq.shape == wq.shape == (n_tokens, got.F)
        if ties:
            assert np.abs(gx - wx).max() <= 1e-2 * np.abs(wx).max()
        else:
            np.testing.assert_allclose(gx, wx, rtol=1e-4, atol=1e-5)
        gc, wc = (decode_magnitude(torch.from_numpy(q)).numpy() for q in (gq, wq))
        steps = np.abs(gq.astype(np.int16) - wq.astype(np.int16))  # codes: 8 per octave, 0 = inactive
        off = ((steps > 1) | ((gq > 0) != (wq > 0))) & ~rounding[l]
        assert off.sum() <= ties * off.size, (l, np.argwhere(off)[:8], gc[off][:8], wc[off][:8])
        assert (gq != wq).mean() < 0.01  # codes differ only at a rounding boundary
        assert 0.01 < (wq > 0).mean() < 0.99  # neither all nor no neurons active


@pytest.mark.parametrize("variant, seq_len, chunk", [
    ("llama-reglu", 16, 32),  # two whole windows a step
    ("llama-reglu", 32, 8),  # a window in four chunks
    ("opt", 16, 32),  # biases, learned positions
    ("falcon", 16, 32),  # parallel attention: the predictor input is the layer input
])
def test_engine_samples_equal_the_reference_samples(tmp_path, variant, seq_len, chunk):
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=3, n_layer=3, n_ctx=64)
    ref = ReferenceModel.from_file(path)
    windows = _windows(ref.cfg.n_vocab, 6, seq_len)
    got, want = _both(ref, path, windows, prefill_chunk=chunk, max_batch=4)
    assert_same_samples(got, want, ref, windows)


def test_every_neuron_on_the_primary(tmp_path):
    """Without a CPU shard the primary's own neurons are the whole layer."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=4, n_layer=2, n_ctx=64)
    ref = ReferenceModel.from_file(path)
    windows = _windows(ref.cfg.n_vocab, 4, 16, seed=1)
    got, want = _both(ref, path, windows, mixed=False, prefill_chunk=32, max_batch=4)
    assert_same_samples(got, want, ref, windows)


def test_quantized_rows(tmp_path):
    """Q8_0 rows: the CPU shard's activations recomputed from its blocks on the primary, the
    primary's own as its oracle finds them (x rounded to Q8_0 on the CPU), against the kernels'
    reference. Where the rounding of x to Q8_0 is a tie, the runtime's fp32 value may round the
    other way (``KernelReference.ties``): the step moves that token and, through attention, the
    later tokens of its window (here two tokens: 18 of 49152 contributions, x by 1e-3)."""
    from quant_models import KernelReference

    path = write_tiny_model(tmp_path / "m.gguf", "llama-gqa", seed=1, n_layer=3, n_ctx=64, n_embd=128, dtype="q8_0")
    ref = KernelReference.from_file(path)
    windows = _windows(ref.cfg.n_vocab, 4, 16, seed=2)
    got, want = _both(ref, path, windows, prefill_chunk=32, max_batch=4)
    assert_same_samples(got, want, ref, windows, ties=5e-3)


@pytest.mark.parametrize("on", ["gate", "h"])
def test_sparsified_swiglu(tmp_path, on):
    """A SwiGLU model with activation thresholds: the samples hold the thresholded h, as the
    reference's hooks see it."""
    from swiglu_models import sparsified

    path = sparsified(tmp_path / "s.gguf", 0.5, on)
    ref = ReferenceModel.from_file(path)
    windows = _windows(ref.cfg.n_vocab, 4, 32, seed=3)
    got, want = _both(ref, path, windows, prefill_chunk=64, max_batch=2)
    assert_same_samples(got, want, ref, windows)


@pytest.mark.parametrize("kw, words", [
    (dict(policy="dense"), "policy='dense': predictor samples through the engine are the true activations"),
    (dict(prefill_dense_min=64), "prefill_dense_min=64: predictor samples through the engine need every neuron"),
])
def test_settings_that_would_hide_activations(kw, words):
    with pytest.raises(ValueError, match=words):
        engine_collector(EngineConfig("m.gguf", **kw))


def test_a_sink_needs_dense_steps(tmp_path):
    """The primary refuses a step whose CPU-side activations it would not see."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=3, n_layer=2, n_ctx=64)
    cfg = ReferenceModel.from_file(path).cfg
    eng = LocalEngine(EngineConfig(str(path), plan=_mixed(cfg), policy="oracle", prefill_chunk=16, max_batch=2,
                                   prefill_dense_min=8, device="cpu"))
    try:
        seen = []
        eng.primary.sample_sink = lambda l, x, h: seen.append((l, x.shape, h.shape))
        eng.primary.step([0], [list(range(8))], [0])
        assert seen == [(0, (8, cfg.n_embd), (8, cfg.n_ff)), (1, (8, cfg.n_embd), (8, cfg.n_ff))]
        with pytest.raises(ValueError, match="a step of 4 tokens with a sample sink"):
            eng.primary.step([1], [list(range(4))], [0])
    finally:
        eng.close()


TRAIN, HELD = "builtin:stdlib:train", "builtin:pydoc:heldout"
ARGS = ["--heldout", HELD, "--heldout-tokens", "1024", "--max-tokens", "4096", "--seq-len", "128", "--recall", "0.95",
        "--max-width", "64", "--device", "cpu"]


def test_train_predictors_command_through_the_engine(tmp_path):
    """The embedded tiny model, 40 % of each layer's neurons on the primary and the rest in the CPU
    executor's shard: the predictors trained on the engine's samples reach the held-out recall and
    sparsity of those trained on the reference's (the same samples within fp32 rounding)."""
    want = train_predictors(trained_model_path(), TRAIN, tmp_path / "ref.gguf", target=None, heldout=HELD,
                            recall_target=0.95, max_tokens=4096, heldout_tokens=1024, seq_len=128, max_width=64,
                            device="cpu", per_layer=False, progress=False, log=lambda m: None)
    out, report = tmp_path / "engine.gguf", tmp_path / "engine.json"
    assert cli.main(["train-predictors", TRAIN, "-o", str(out), *ARGS, "--json", str(report), "--engine",
                     "--gpu-fraction", "0.4", "--prefill-chunk", "256"]) == 0
    got = json.loads(report.read_text())
    assert got["n_train_tokens"] == want.n_train_tokens == 4096 and got["target_met"]
    assert ModelFile(out).config.predictor_ranks == (64,) * 6
    for g, w in zip(got["layers"], want.layers, strict=True):
        assert g["recall"] >= 0.95 and g["recall"] == pytest.approx(w.recall, abs=0.005), (g, w)
        assert g["kept"] == pytest.approx(w.kept, abs=0.005) and g["kept"] < 0.5, (g, w)
    assert got["ppl_sparse"] == pytest.approx(want.ppl_sparse, rel=1e-3)


@pytest.mark.parametrize("argv, words", [
    (["--gpu-fraction", "0.4"], "--gpu-fraction is an engine flag: add --engine to run train-predictors"),
    (["--engine", "--policy", "predictor"], "--policy predictor: train-predictors --engine needs the true activity"),
    (["--engine", "--prefill-dense-min", "8"], "prefill_dense_min=8: predictor samples through the engine need"),
    (["--engine", "-c", "64"], "sequence reaches 128 tokens, beyond the context n_ctx=64"),  # the engine runs them
])
def test_train_predictors_refuses_engine_flags_that_do_not_apply(tmp_path, capsys, argv, words):
    assert cli.main(["train-predictors", TRAIN, "-o", str(tmp_path / "p.gguf"), *ARGS, *argv]) == 2
    assert words in capsys.readouterr().err
