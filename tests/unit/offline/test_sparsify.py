"""SwiGLU thresholds: the thresholded reference FFN against a hand computation, calibration that
reaches its target on the calibration text, the file that carries the thresholds, the CLI,
profiling from the thresholded mask, and the errors (ReLU models, other models' thresholds,
wrong layer counts, short corpora)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn

from powerinfer_ray.cli import main
from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.config import ConfigError
from powerinfer_ray.model.gguf_config import ModelFileError
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.reference import ReferenceModel, rms_norm
from powerinfer_ray.model.tiny import tiny_config, tiny_weights, write_tiny_model
from powerinfer_ray.model.tokenizer import Tokenizer, byte_level_fields
from powerinfer_ray.offline.profile import profile_activations
from powerinfer_ray.offline.sparsify import (MIN_CALIBRATION_TOKENS, calibrate, calibration_windows,
                                             sparsify)

DOCS = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7} times, "
        f"while the {('red', 'green', 'blue')[i % 3]} cat sleeps." for i in range(60)]
SHAPE = dict(n_layer=3, n_ff=256, n_ctx=128)


@pytest.fixture(scope="module")
def swiglu(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "swiglu.gguf", "llama-swiglu", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def sparse(swiglu, tmp_path_factory):
    out = tmp_path_factory.mktemp("s") / "sparse.gguf"
    th = sparsify(swiglu, DOCS, out, [0.3, 0.5, 0.7], seq_len=64, device="cpu", log=lambda m: None)
    return out, th


def zero_share(ref: ReferenceModel, windows) -> np.ndarray:
    """Per layer, the share of h that is exactly zero over the windows [L]."""
    zeros = np.zeros(ref.cfg.n_layer)
    n = 0

    class Count:
        def mask(self, layer, pred_in):
            return None

        def observe(self, layer, pred_in, h):
            zeros[layer] += float((h == 0).sum())

    for w in windows:
        ref.forward(w, ref.new_cache(), Count())
        n += len(w) * ref.cfg.n_ff
    return zeros / n


@pytest.mark.parametrize("on", ["gate", "h"])
def test_thresholded_ffn_equals_hand_computation(on):
    cfg = tiny_config("llama-swiglu", **SHAPE)
    w = tiny_weights(cfg, seed=1)
    ref = ReferenceModel(cfg, w, dtype=torch.float64)
    t = [0.05, 0.1, 0.2]
    ref.set_thresholds(t, on)
    x = torch.randn(7, cfg.n_embd, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for l in range(cfg.n_layer):
        g = x @ w[K.tensor(K.FFN_GATE, l)].double().T  # [T, F]
        u = x @ w[K.tensor(K.FFN_UP, l)].double().T
        h = g * torch.sigmoid(g) * u
        crit = (g * torch.sigmoid(g)).abs() if on == "gate" else h.abs()
        want = torch.where(crit > t[l], h, 0.0) @ w[K.tensor(K.FFN_DOWN_T, l)].double()  # [T, D]
        assert 0.05 < float((crit <= t[l]).double().mean()) < 0.95  # the threshold does bite
        torch.testing.assert_close(ref.ffn(l, x), want, rtol=1e-12, atol=1e-12)
    ref.set_thresholds(None)
    dense = Fn.silu(x @ w[K.tensor(K.FFN_GATE, 0)].double().T) * (x @ w[K.tensor(K.FFN_UP, 0)].double().T)
    torch.testing.assert_close(ref.ffn(0, x), dense @ w[K.tensor(K.FFN_DOWN_T, 0)].double())


@pytest.mark.parametrize("on", ["gate", "h"])
def test_calibration_reaches_each_layers_target_on_its_text(swiglu, on):
    ref = ReferenceModel.from_file(swiglu)
    windows = calibration_windows(Tokenizer(ModelFile(swiglu).fields), DOCS, 4096, 64)
    target = [0.2, 0.5, 0.65]
    values = calibrate(ref, windows, target, on)
    assert values[0] > 0 and ref.thresholds == values
    n = sum(map(len, windows)) * ref.cfg.n_ff
    np.testing.assert_allclose(zero_share(ref, windows), target, atol=2 / n)


def test_sparsified_file_carries_thresholds_and_every_tensor(swiglu, sparse):
    out, th = sparse
    src, mf = ModelFile(swiglu), ModelFile(out)
    assert mf.config.ffn_thresholds == th.values and mf.config.ffn_threshold_on == "gate"
    assert mf.config.with_(ffn_thresholds=()) == src.config
    assert mf.meta(K.FFN_TARGET_SPARSITY) == pytest.approx([0.3, 0.5, 0.7])
    assert mf.meta(K.FFN_CALIBRATION_TOKENS) == th.tokens >= MIN_CALIBRATION_TOKENS
    assert mf.meta(K.TOK_TOKENS) == src.meta(K.TOK_TOKENS) and mf.magic == src.magic
    assert list(mf.tensors) == list(src.tensors)
    for name in src.tensors:
        np.testing.assert_array_equal(mf.raw(name), src.raw(name))
    # it runs thresholded by default, dense on request
    ref, dense = ReferenceModel.from_file(out), ReferenceModel.from_file(out, thresholded=False)
    windows = calibration_windows(Tokenizer(mf.fields), DOCS, 16384, 64)  # sparsify's calibration text
    np.testing.assert_allclose(zero_share(ref, windows), [0.3, 0.5, 0.7], atol=1e-4)
    assert zero_share(dense, windows[:2]).max() == 0.0
    plain = ReferenceModel.from_file(swiglu)
    torch.testing.assert_close(dense.forward(windows[0], dense.new_cache()),
                               plain.forward(windows[0], plain.new_cache()))


def test_profile_counts_the_thresholded_mask(sparse):
    """Counts from profile equal a hand count of |SiLU(gate)| > t_l on the thresholded forward."""
    out, th = sparse
    stats = profile_activations(out, DOCS, max_tokens=1024, seq_len=64, progress=False, device="cpu")
    ref = ReferenceModel.from_file(out)
    counts = np.zeros((3, 256), dtype=np.int64)

    class Hand:
        def mask(self, layer, pred_in):
            return None

        def observe(self, layer, pred_in, h):
            x = rms_norm(pred_in, ref.w[K.tensor(K.FFN_NORM, layer)], ref.cfg.norm_eps)
            g = x @ ref.w[K.tensor(K.FFN_GATE, layer)].T
            counts[layer] += (Fn.silu(g).abs() > th.values[layer]).sum(0).numpy()

    tok = Tokenizer(ModelFile(out).fields)
    for w in calibration_windows(tok, DOCS, 1024, 64):
        ref.forward(w, ref.new_cache(), Hand())
    assert stats.n_tokens == 1024
    np.testing.assert_array_equal(stats.counts, counts)
    np.testing.assert_allclose(stats.sparsity(), [0.3, 0.5, 0.7], atol=0.05)


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_0"])
def test_thresholds_carry_over_to_the_same_model_at_another_dtype(tmp_path, sparse, dtype):
    """Thresholds calibrated at f32 apply to the f16 / q8_0 / q4_0 file of the same weights; the
    copy keeps every tensor's bytes (blocks stay blocks)."""
    out, th = sparse
    other = write_tiny_model(tmp_path / "m.gguf", "llama-swiglu", seed=3, dtype=dtype, **SHAPE)
    got = sparsify(other, None, tmp_path / "sparse.gguf", thresholds_from=out, log=lambda m: None)
    assert got.values == th.values and got.target == pytest.approx(th.target)
    src, mf = ModelFile(other), ModelFile(tmp_path / "sparse.gguf")
    assert mf.config.ffn_thresholds == th.values and mf.config.dtype == dtype
    for name in src.tensors:
        assert mf.dtype_of(name) == src.dtype_of(name)
        np.testing.assert_array_equal(mf.raw(name), src.raw(name))


def test_thresholds_of_another_model_are_refused(tmp_path, sparse):
    out, _ = sparse
    other = write_tiny_model(tmp_path / "other.gguf", "llama-swiglu", seed=4, **SHAPE)
    with pytest.raises(ValueError, match=r"calibrated on another model: the gate weights differ by \d+ %"):
        sparsify(other, None, tmp_path / "o.gguf", thresholds_from=out, log=lambda m: None)
    deeper = write_tiny_model(tmp_path / "deeper.gguf", "llama-swiglu", seed=3, **{**SHAPE, "n_layer": 4})
    with pytest.raises(ValueError, match="3 layers, the model 'tiny-llama-swiglu' has 4"):
        sparsify(deeper, None, tmp_path / "d.gguf", thresholds_from=out, log=lambda m: None)
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "d.gguf").exists()


def test_a_file_with_the_wrong_number_of_thresholds_is_refused(tmp_path):
    cfg = tiny_config("llama-swiglu", **SHAPE)
    meta = {**byte_level_fields(), K.FFN_THRESHOLDS: [0.1, 0.2]}
    path = write_model(tmp_path / "bad.gguf", cfg, tiny_weights(cfg), metadata=meta)
    with pytest.raises(ModelFileError, match="ffn_thresholds is '2 values', expected one per layer: n_layer=3"):
        ModelFile(path)
    with pytest.raises(ConfigError, match="ffn_thresholds.*SwiGLU"):
        tiny_config("llama-reglu", **SHAPE).with_(ffn_thresholds=(0.1, 0.1, 0.1))


def test_relu_family_models_need_no_thresholds(tmp_path):
    reglu = write_tiny_model(tmp_path / "reglu.gguf", "llama-reglu", **SHAPE)
    with pytest.raises(ValueError, match="ffn_act is reglu, whose zeros are already activation sparsity; "
                                         "thresholds are for SwiGLU models and not needed here"):
        sparsify(reglu, DOCS, tmp_path / "o.gguf", 0.5)


def test_a_short_corpus_says_how_many_tokens_it_needs(swiglu, tmp_path):
    with pytest.raises(ValueError, match=rf"gave 320 tokens in windows of 64; calibrating thresholds "
                                         rf"needs at least {MIN_CALIBRATION_TOKENS} tokens"):
        sparsify(swiglu, DOCS[:4], tmp_path / "o.gguf", 0.5, seq_len=64)


@pytest.mark.parametrize("bad, msg", [([1.0], "layer 0 is 1.0, expected 0 <= s < 1"),
                                      ([0.1, 0.2], "2 values, expected 1 or one per layer")])
def test_bad_targets_are_refused(swiglu, tmp_path, bad, msg):
    with pytest.raises(ValueError, match=msg):
        sparsify(swiglu, DOCS, tmp_path / "o.gguf", bad)


def test_cli_sparsify_and_inspect(swiglu, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(DOCS))
    out = tmp_path / "cli.gguf"
    assert main(["sparsify", "-m", str(swiglu), str(corpus), "--target-sparsity", "0.3,0.4", "0.6",
                 "--seq-len", "64", "-o", str(out)]) == 0
    cfg = ModelFile(out).config
    assert ModelFile(out).meta(K.FFN_TARGET_SPARSITY) == pytest.approx([0.3, 0.4, 0.6])
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "thresholds: neuron j active iff |SiLU(gate_j)| > t_l (calibrated on" in text
    for l, t in enumerate(cfg.ffn_thresholds):
        assert f"{l:>5} {t:>10.4g} {[0.3, 0.4, 0.6][l]:>15.3f}" in text
    assert main(["sparsify", "-m", str(swiglu), str(corpus), "--target-sparsity", "half", "-o", str(out)]) == 2
    assert "--target-sparsity: 'half' is not a number" in capsys.readouterr().err


def test_inspect_shows_the_rotary_dims(tmp_path, capsys):
    """n_rot as the file says: all of head_dim (64 here), a part of it, or 0 without RoPE."""
    for name, variant, kw, want in (("full", "llama-swiglu", {}, 64), ("part", "llama-swiglu", {"n_rot": 32}, 32),
                                    ("opt", "opt", {}, 0)):
        path = write_tiny_model(tmp_path / f"{name}.gguf", variant, n_embd=256, n_layer=1, **kw)
        capsys.readouterr()
        assert main(["inspect", str(path)]) == 0
        assert f"  n_rot = {want}\n" in capsys.readouterr().out
