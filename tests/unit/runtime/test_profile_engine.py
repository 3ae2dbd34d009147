"""``profile --engine``: the corpus's windows through the hybrid engine (runtime/engine_profile.py)
count what the single-device profile counts on the same windows, on a split with neurons on both
executors, through the CPU executor's answers and through dense prefill on the primary."""
from __future__ import annotations

import numpy as np
import pytest

from powerinfer_ray import cli
from powerinfer_ray.model.default import default_model_path
from powerinfer_ray.offline.profile import ActivationStats, profile_activations
from powerinfer_ray.runtime.config import EngineConfig
from powerinfer_ray.runtime.engine import LocalEngine
from powerinfer_ray.runtime.engine_profile import oracle_config, profile_engine, profile_with_engine, window_shape

CORPUS, MAX, SEQ = "builtin:heldout", 2048, 64


@pytest.fixture(scope="module")
def single_device():
    return profile_activations(default_model_path(), CORPUS, MAX, SEQ, progress=False, device="cpu")


def _close(got: ActivationStats, want: ActivationStats) -> None:
    """The same tokens and model; the counts equal but for decisions on activations within fp32
    rounding of zero (the engine's sums add in another order: a gate of 4e-7 was seen to flip),
    at most 1e-4 of the activations counted."""
    assert got.n_tokens == want.n_tokens == MAX and got.model == want.model and got.counts.shape == want.counts.shape
    assert np.abs(got.counts - want.counts).sum() <= 1e-4 * want.counts.sum()
    assert 0 < want.counts.sum() < want.counts.size * MAX


@pytest.mark.parametrize("kw", [
    dict(gpu_fraction=0.4, prefill_chunk=32, max_batch=4),  # two windows a step, the CPU executor's answers
    dict(gpu_fraction=0.4, prefill_chunk=128, max_batch=4, prefill_dense_min=16),  # the CPU shard on the primary
])
def test_engine_profile_counts_the_single_device_profile(single_device, kw):
    got = profile_with_engine(EngineConfig(str(default_model_path()), **kw), CORPUS, MAX, SEQ, progress=False)
    _close(got, single_device)


def test_profile_engine_counts_the_windows_alone(single_device):
    """On an engine already open that has run other tokens: the profile is the windows' alone."""
    ec = EngineConfig(str(default_model_path()), gpu_fraction=0.4, prefill_chunk=32, max_batch=4)
    eng = LocalEngine(oracle_config(ec, "a profile"))
    try:
        eng.primary.step([0], [list(range(5, 37))], [0])
        assert eng.activation_stats().n_tokens == 32
        _close(profile_engine(eng, CORPUS, MAX, SEQ, progress=False), single_device)
    finally:
        eng.close()


def test_profile_engine_refuses_an_engine_that_does_not_count_the_true_activations():
    eng = LocalEngine(EngineConfig(str(default_model_path()), policy="dense", max_batch=1))
    try:
        with pytest.raises(ValueError, match="policy 'dense': an activation profile counts the true activations"):
            profile_engine(eng, CORPUS, MAX, SEQ, progress=False)
    finally:
        eng.close()


def test_window_shape():
    assert window_shape(64, 128, 8) == (2, 64)  # two whole windows a step
    assert window_shape(256, 64, 8) == (1, 64)  # a window in four chunks
    assert window_shape(16, 256, 4) == (4, 16)  # at most the KV cache's slots


def test_profile_command_through_the_engine(tmp_path, single_device):
    """The command writes the single-device profile's files: ``solve --activation`` reads them."""
    out = tmp_path / "prof"
    assert cli.main(["profile", CORPUS, "-o", str(out), "--max-tokens", str(MAX), "--seq-len", str(SEQ), "--engine",
                     "--gpu-fraction", "0.5", "--prefill-chunk", "64", "--device", "cpu"]) == 0
    _close(ActivationStats.load_parquet(out / "activation.parquet"), single_device)
    _close(ActivationStats.load_pt(out / "activation"), single_device)


@pytest.mark.parametrize("argv, words", [
    (["--vram-budget-gib", "1"], "--vram-budget-gib is an engine flag: add --engine"),
    (["--engine", "--policy", "dense"], "--policy dense: profile --engine needs the true activity"),
])
def test_profile_refuses_engine_flags_that_do_not_apply(tmp_path, capsys, argv, words):
    assert cli.main(["profile", CORPUS, "-o", str(tmp_path / "p"), *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("flags, want", [(["--seq-len", "48"], 48), (["--seq-len", "100000"], None),
                                         (["--seq-len", "48", "-c", "96"], 96)])
def test_engine_context_is_the_window_unless_given(tmp_path, flags, want):
    """profile / train-predictors --engine size the engine's context (its KV cache in the VRAM budget)
    to a window, at most the model's context, unless -c says otherwise."""
    from powerinfer_ray.model.source import open_model

    model_ctx = open_model(str(default_model_path())).config.n_ctx
    for cmd in (["profile", CORPUS, "-o", str(tmp_path / "p")], ["train-predictors", CORPUS, "-o", str(tmp_path / "m")]):
        a = cli.build_parser().parse_args([*cmd, "--engine", "--device", "cpu", *flags])
        assert cli._offline_engine(a).n_ctx == (want or model_ctx) < 100000, cmd
