"""The engine's own activation counts (runtime/activity.py): under 'oracle' they equal the dense
reference's true activity on the same tokens, under 'predictor' the predictor's decisions
computed from the file's predictors; both through the eager steps and the decode segments, with
neurons on both executors; written out, ``solve`` places neurons from them."""
from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest
import torch

from powerinfer_ray.model.costs import model_costs
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.kernels import sparse_ffn
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.offline.profile import ActivationStats
from powerinfer_ray.offline.solve import solve_for_model
from powerinfer_ray.placement.gpuidx import read_gpuidx
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.plan import Plan
from ties import assert_counts, predictor_weights

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], list(range(30, 42)), [200, 1, 2, 3]]
NEXT = [[11, 12, 13], [40, 41, 42], [7, 99, 150]]  # three decode steps of all three sequences


SEQUENCES = [p + [t[s] for t in NEXT] for s, p in enumerate(PROMPTS)]


def _assert_counts(ref, got: np.ndarray, sequences=SEQUENCES, predictors: bool = False,  # noqa: ANN001
                   threshold: float = 0.0) -> np.ndarray:
    """Assert the engine's counts ``got`` are the reference's over ``sequences`` (each on its own),
    up to decisions within rounding of their threshold (``ties.assert_counts``); returns them."""
    pred = predictor_weights(ModelFile(ref.path), ref.cfg.n_layer, threshold) if predictors else None
    return assert_counts(ref, sequences, got, pred)


def _reference(path):  # noqa: ANN001, ANN202
    ref = ReferenceModel.from_file(path, dtype=torch.float64)
    ref.path = path
    return ref


def _engine_counts(eng: LocalEngine) -> ActivationStats:
    """Prefill each prompt (chunks of the engine's), then NEXT as batched decode steps (three
    sequences padded to a bucket of four in the segments)."""
    chunk = eng.primary.t_max
    for slot, p in enumerate(PROMPTS):
        for i in range(0, len(p), chunk):
            eng.primary.step([slot], [p[i:i + chunk]], [i])
    pos = [len(p) for p in PROMPTS]
    for toks in NEXT:
        eng.primary.step([0, 1, 2], [[t] for t in toks], pos)
        pos = [q + 1 for q in pos]
    return eng.activation_stats()


def _mixed(cfg, seed=0) -> Plan:
    rng = np.random.default_rng(seed)
    groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return Plan.from_masks([rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)], groups, cfg)


N_TOKENS = sum(len(p) for p in PROMPTS) + sum(len(t) for t in NEXT)


@pytest.mark.parametrize("variant", ["llama-reglu", "opt", "falcon"])
@pytest.mark.parametrize("dense_prefill", [False, True])
def test_oracle_counts_equal_the_true_activity(tmp_path, variant, dense_prefill):
    """Policy 'oracle' over a split with neurons on both executors: the primary counts its own
    neurons (and the CPU shard's in dense prefill), the CPU executor its own; summed, they are
    the dense reference's count of nonzero activations on the same tokens."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=3, n_layer=3, n_ctx=64)
    cfg = ReferenceModel.from_file(path).cfg
    eng = LocalEngine(EngineConfig(str(path), plan=_mixed(cfg), policy="oracle", prefill_chunk=8, max_batch=4,
                                   prefill_dense_min=8 if dense_prefill else 0))
    try:
        assert eng.cpu is not None and (eng.group.dense_prefill is not None) == dense_prefill
        got = _engine_counts(eng)
        summary = eng.stats()["activation"]
        cpu_counted = eng.cpu.activation_counts()
    finally:
        eng.close()
    assert got.n_tokens == N_TOKENS and got.model == cfg.name
    want = _assert_counts(_reference(path), got.counts)
    assert 0 < want.sum() < want.size * N_TOKENS  # sparse: some neurons fire, not all
    # the CPU executor counted its neurons' decode tokens at least (prefill too without dense prefill)
    cpu_ids = [lp.cpu_neurons for lp in _mixed(cfg).layers]
    assert all(cpu_counted[l, ids].sum() > 0 for l, ids in enumerate(cpu_ids))
    assert summary == {"counted": True, "tokens": N_TOKENS,
                       "mean_active_fraction": pytest.approx(want.sum() / (N_TOKENS * want.size))}


@pytest.mark.parametrize("variant", ["llama-reglu", "falcon-gqa"])
@pytest.mark.parametrize("graphs, zero_copy", [(False, 0.0), (True, 0.0), (True, 0.5)])
def test_predictor_counts_equal_the_predictor_decisions(tmp_path, variant, graphs, zero_copy):
    """Policy 'predictor': the primary counts the decision of every neuron of the layer (its own
    and the CPU executor's), in the eager steps and in the decode segments (graphs, run eagerly
    on the CPU; the padding row of a bucket counts nothing; with zero-copy, the CPU's neurons it
    computes once), at the threshold the engine runs."""
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=5, n_layer=3, n_ctx=64, predictor_rank=16)
    cfg = ReferenceModel.from_file(path).cfg
    eng = LocalEngine(EngineConfig(str(path), plan=_mixed(cfg, 1), policy="predictor", threshold=0.3,
                                   predictor_margin=0.1, prefill_chunk=8, max_batch=4, graphs=graphs,
                                   zero_copy=zero_copy))
    try:
        got = _engine_counts(eng)
        assert (4 in eng.primary.graphs) == graphs  # three sequences padded to four
        assert not eng.cpu.activation_counts().any()  # it decides nothing under 'predictor'
    finally:
        eng.close()
    assert got.n_tokens == N_TOKENS
    want = _assert_counts(_reference(path), got.counts, predictors=True, threshold=0.2)
    assert 0 < want.sum() < want.size * N_TOKENS


def test_counts_reset_and_policies_without_counts(tmp_path):
    """reset=True hands the counts over and starts afresh; 'dense' keeps none and says so."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=3, n_layer=2, n_ctx=64)
    eng = LocalEngine(EngineConfig(str(path), policy="oracle", prefill_chunk=8, max_batch=4))
    try:
        eng.primary.step([0], [[1, 2, 3]], [0])
        first = eng.activation_stats(reset=True)
        assert first.n_tokens == 3 and first.counts.sum() > 0
        after = eng.activation_stats()
        assert after.n_tokens == 0 and after.counts.sum() == 0
    finally:
        eng.close()
    eng = LocalEngine(EngineConfig(str(path), policy="dense", prefill_chunk=8, max_batch=4))
    try:
        eng.primary.step([0], [[1, 2, 3]], [0])
        assert eng.stats()["activation"] == {"counted": False, "tokens": 0, "mean_active_fraction": 0.0}
        with pytest.raises(ValueError, match="policy 'dense'.*'oracle'"):
            eng.activation_stats()
    finally:
        eng.close()


def test_counts_read_and_reset_while_the_engine_generates(tmp_path):
    """Reads with reset=True while requests run through the engine's scheduler happen between
    steps: every period is a valid profile (no neuron above its tokens) and the periods add up
    to the reference's counts over all the tokens the engine ran."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=3, n_layer=2, n_ctx=128)
    ref = _reference(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_mixed(ref.cfg), policy="oracle", prefill_chunk=8, max_batch=4))
    prompts = [list(range(10 + i, 30 + 2 * i)) for i in range(3)]
    outs: list = []

    async def run() -> None:
        outs.extend(await asyncio.gather(*[eng.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True)
                                           for p in prompts]))
    th = threading.Thread(target=asyncio.run, args=(run(),))
    th.start()
    periods = []
    try:
        while th.is_alive():
            periods.append(eng.activation_stats(reset=True))  # raises if counts ran ahead of tokens
        th.join()
        periods.append(eng.activation_stats(reset=True))
    finally:
        th.join()
        eng.close()
    ran = [p + o["token_ids"][:-1] for p, o in zip(prompts, outs)]
    assert sum(p.n_tokens for p in periods) == sum(len(r) for r in ran) and len(periods) > 2
    _assert_counts(ref, sum(p.counts for p in periods), ran)


def test_written_counts_solve_to_a_placement_of_the_hot_neurons(tmp_path):
    """The counts written as the profile writes them are what ``solve --activation`` reads: the
    solved split puts the engine's most active neurons on the GPU."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=3, n_layer=2, n_ctx=64)
    eng = LocalEngine(EngineConfig(str(path), policy="oracle", prefill_chunk=16, max_batch=4))
    try:
        eng.primary.step([0], [list(range(40, 72))], [0])
        st = eng.activation_stats()
    finally:
        eng.close()
    out = st.save(tmp_path / "traffic")
    back = ActivationStats.load_parquet(out / "activation.parquet")
    np.testing.assert_array_equal(back.counts, st.counts)
    np.testing.assert_array_equal(ActivationStats.load_pt(out / "activation").counts, st.counts)
    cfg = ReferenceModel.from_file(path).cfg
    costs = model_costs(cfg, cfg.n_ctx, 1)
    # everything but half of the FFN neurons fits
    budget = costs.min_budget_bytes(False) + sum(costs.neuron_bytes) * cfg.n_ff // 2
    solve_for_model(str(path), out, budget / 2**30, method="greedy", group_size=8, out=str(tmp_path / "m.gpuidx"),
                    n_ctx=cfg.n_ctx)
    split = read_gpuidx(tmp_path / "m.gpuidx")
    for l in range(cfg.n_layer):
        on_gpu = np.asarray(split.gpu_neurons[l], bool)
        assert 0 < on_gpu.sum() < cfg.n_ff
        assert st.counts[l][on_gpu].mean() > st.counts[l][~on_gpu].mean()  # the hot ones on the GPU


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dense_prefill", [False, True])
def test_oracle_counts_of_a_quantized_model(tmp_path, qtype, dense_prefill):
    """Quantized rows (the CPU kernels round x to Q8_0; dense prefill finds the CPU shard's
    activity from its blocks on the primary): the counts are the kernels' reference's."""
    from quant_models import KernelReference

    path = write_tiny_model(tmp_path / "m.gguf", "llama-gqa", seed=1, n_layer=3, n_ctx=64, n_embd=128, dtype=qtype)
    ref = KernelReference.from_file(path)
    eng = LocalEngine(EngineConfig(str(path), plan=_mixed(ref.cfg), policy="oracle", prefill_chunk=8, max_batch=4,
                                   prefill_dense_min=8 if dense_prefill else 0))
    try:
        assert (eng.group.dense_prefill is not None) == dense_prefill
        got = _engine_counts(eng)
    finally:
        eng.close()
    _assert_counts(ref, got.counts)


@pytest.mark.parametrize("variant", ["llama-reglu", "opt"])
def test_the_matrix_multiply_path_counts_and_computes_as_the_kernels(tmp_path, monkeypatch, variant):
    """The path a prompt chunk takes on a GPU (sparse_ffn_gemm: every row multiplied, h zeroed
    outside the active rows; under 'oracle' h and the counts from the same multiplies), forced
    for every call here: the oracle counts are the dense reference's true activity and every
    step's logits those of the kernels' path."""
    from powerinfer_ray.runtime import layers

    kernel_module = sys.modules[sparse_ffn.__module__]  # the package exports the function under its name
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=3, n_layer=3, n_ctx=64)
    cfg = ReferenceModel.from_file(path).cfg
    logits = {}
    for gemm in (False, True):
        for module in (kernel_module, layers):
            monkeypatch.setattr(module, "takes_gemm", lambda x, g=gemm: g)
        eng = LocalEngine(EngineConfig(str(path), plan=_mixed(cfg), policy="oracle", prefill_chunk=8, max_batch=4,
                                       graphs=False))
        try:
            outs = []
            step = eng.primary.step
            eng.primary.step = lambda *a, _s=step: outs.append(np.array(_s(*a), copy=True)) or outs[-1]
            got = _engine_counts(eng)
        finally:
            eng.close()
        _assert_counts(_reference(path), got.counts)
        logits[gemm] = outs
    assert len(logits[True]) == len(logits[False]) > 0
    for a, b in zip(logits[False], logits[True]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["predictor", "dense"])
def test_the_matrix_multiply_path_takes_the_mask_over_every_row(tmp_path, monkeypatch, policy):
    """Policies 'predictor' and 'dense' on the path a prompt chunk takes on a GPU (forced here): the
    predictor's mask over every row, without a list of the active ones, gives the prompt steps' logits
    of the kernels' path and the same count of (token, neuron) pairs computed."""
    from powerinfer_ray.runtime import layers

    kernel_module = sys.modules[sparse_ffn.__module__]
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=5, n_layer=3, n_ctx=64, predictor_rank=16)
    cfg = ReferenceModel.from_file(path).cfg
    got = {}
    for gemm in (False, True):
        for module in (kernel_module, layers):
            monkeypatch.setattr(module, "takes_gemm", lambda x, g=gemm: g)
        eng = LocalEngine(EngineConfig(str(path), plan=_mixed(cfg, 1), policy=policy, threshold=0.3, prefill_chunk=8,
                                       max_batch=4, graphs=False))
        try:
            chunk, outs = eng.primary.t_max, []
            for slot, p in enumerate(PROMPTS):
                for i in range(0, len(p), chunk):
                    outs.append(np.array(eng.primary.step([slot], [p[i:i + chunk]], [i]), copy=True))
            got[gemm] = outs, eng.primary.stats.neurons
        finally:
            eng.close()
    assert got[False][1] == got[True][1] > 0
    for a, b in zip(got[False][0], got[True][0]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
