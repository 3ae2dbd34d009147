"""SwiGLU execution modes in the runtime (without Ray), on sparsified tiny models: gate-first and
oracle masks against the thresholded dense reference on every split, the predicted mode against
the reference masked by the same predictors, the dense policy against the unthresholded model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_models import match_rounding
from swiglu_models import sparsified
from ties import DecisionReference, predictor_weights

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.offline.train_tiny import trained_swiglu_path
from powerinfer_ray.runtime.config import resolve_policy
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.plan import Plan

PROMPT, DECODE = [5, 60, 7, 200, 41, 12, 99, 150, 3, 42, 17, 250, 8, 77, 120, 31, 64], [7, 99, 150, 3, 42]


def _plans(cfg):
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.3 for _ in range(cfg.n_layer)]
    half = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return {"all-gpu": Plan.all_gpu(cfg), "all-cpu": Plan.all_cpu(cfg), "mixed": Plan.from_masks(masks, None, cfg),
            "split-heads": Plan.from_masks(masks, half, cfg)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The trained tiny SwiGLU model sparsified at 0.5 (no predictors)."""
    return ModelFile(sparsified(tmp_path_factory.mktemp("m") / "tiny-swiglu-0.5.gguf"))


@pytest.fixture(scope="module")
def with_predictors(tmp_path_factory):
    """A seeded tiny SwiGLU model with (random) predictors and GQA, sparsified at 0.4."""
    d = tmp_path_factory.mktemp("p")
    src = write_tiny_model(d / "dense.gguf", "llama-swiglu", seed=3, n_layer=3, n_ctx=64, predictor_rank=16,
                           n_head=4, n_head_kv=2)
    return ModelFile(sparsified(d / "sparse.gguf", 0.4, src=src))


class ActivePairs:
    """FFNHooks counting the (token, neuron) pairs with a nonzero (thresholded) h, and applying
    a mask when given one (``mask_fn``)."""

    def __init__(self, mask_fn=None):
        self.pairs, self.mask_fn = 0, mask_fn

    def mask(self, layer, pred_in):
        return None if self.mask_fn is None else self.mask_fn(layer, pred_in)

    def observe(self, layer, pred_in, h):
        m = self.mask(layer, pred_in) if self.mask_fn is not None else None
        self.pairs += int(((h != 0) if m is None else (h != 0) & m).sum())


def _steps(eng: LocalEngine, prompt: list[int], decode: list[int], chunk: int) -> list[np.ndarray]:
    """Prefill in chunks, then decode steps; the logits of each chunk's last token and each step."""
    out, pos = [], 0
    for i in range(0, len(prompt), chunk):
        out.append(eng.primary.step([0], [prompt[i:i + chunk]], [pos])[0])
        pos += len(prompt[i:i + chunk])
    for t in decode:
        out.append(eng.primary.step([0], [[t]], [pos])[0])
        pos += 1
    return out


def _want(ref: ReferenceModel, prompt, decode, chunk, hooks=None) -> list[torch.Tensor]:
    full = ref.forward(prompt + decode, ref.new_cache(), hooks)  # [T, V]
    return [full[min(i + chunk, len(prompt)) - 1] for i in range(0, len(prompt), chunk)] + \
        [full[len(prompt) + j] for j in range(len(decode))]


def _at(chunk: int, prompt=PROMPT, decode=DECODE) -> list[int]:  # noqa: ANN001
    """The positions whose logits ``_steps`` returns: each chunk's last token, each decode step."""
    return [min(i + chunk, len(prompt)) - 1 for i in range(0, len(prompt), chunk)] + \
        [len(prompt) + j for j in range(len(decode))]


def _computed(eng: LocalEngine) -> int:
    return eng.primary.stats.neurons + (eng.cpu.stats.neurons if eng.cpu is not None else 0)


@pytest.mark.parametrize("policy", ["gate-first", "oracle"])
@pytest.mark.parametrize("split", ["all-gpu", "all-cpu", "mixed", "split-heads"])
def test_exact_modes_equal_the_thresholded_reference_on_every_split(trained, policy, split):
    """Gate-first and oracle compute exactly the neurons whose |SiLU(gate)| passes the layer's
    threshold: the logits of the thresholded dense forward, and as many (token, neuron) pairs as it
    has nonzero h."""
    ref = ReferenceModel.from_file(trained, dtype=torch.float64)
    assert ref.thresholds is not None
    eng = LocalEngine(EngineConfig(str(trained.path), plan=_plans(ref.cfg)[split], policy=policy, prefill_chunk=8,
                                   max_batch=2))
    try:
        got = _steps(eng, PROMPT, DECODE, 8)
        computed = _computed(eng)
        if split != "all-gpu":
            assert eng.cpu.stats.exchanges > 0 and eng.cpu.stats.neurons > 0
    finally:
        eng.close()
    masked = DecisionReference(ref)
    errs, flips = match_rounding(masked, PROMPT + DECODE, got, _at(8), tol=1e-4)
    assert max(errs) < 1e-4, (errs, flips)
    masked.flips = flips  # the thresholded mask (with the runtime's sides of its ties), no neuron more or less
    masked.forward(PROMPT + DECODE, masked.new_cache())
    assert computed == masked.counts["threshold"].sum()
    n_all = (len(PROMPT) + len(DECODE)) * ref.cfg.n_ff * ref.cfg.n_layer
    assert 0.4 < computed / n_all < 0.6  # calibrated for 0.5 sparsity on other text


def test_the_metadata_selects_the_mode_and_the_flag_overrides_it(trained, with_predictors, tmp_path):
    ec = lambda m, **kw: EngineConfig(str(m.path), **kw)  # noqa: E731
    assert resolve_policy(ec(trained), trained.config) == "gate-first"
    # with predictors too: gate-first read less than the predicted mode on every SwiGLU model measured
    assert resolve_policy(ec(with_predictors), with_predictors.config) == "gate-first"
    assert resolve_policy(ec(with_predictors, policy="predictor"), with_predictors.config) == "predictor"
    dense = ModelFile(trained_swiglu_path())
    assert resolve_policy(ec(dense), dense.config) == "dense"
    with pytest.raises(ValueError, match="sparsify"):
        resolve_policy(ec(dense, policy="gate-first"), dense.config)
    with pytest.raises(ValueError, match="train-predictors"):
        resolve_policy(ec(trained, policy="predictor"), trained.config)
    on_h = ModelFile(sparsified(tmp_path / "h.gguf", on="h"))
    assert resolve_policy(ec(on_h), on_h.config) == "oracle"
    with pytest.raises(ValueError, match="--on gate"):
        resolve_policy(ec(on_h, policy="gate-first"), on_h.config)


def test_dense_policy_runs_the_unthresholded_model(trained):
    """Policy 'dense' on a sparsified model is the dense baseline: the model without thresholds."""
    ref = ReferenceModel.from_file(trained, thresholded=False)
    eng = LocalEngine(EngineConfig(str(trained.path), plan=_plans(ref.cfg)["mixed"], policy="dense", prefill_chunk=8))
    try:
        got = _steps(eng, PROMPT, DECODE[:2], 8)
    finally:
        eng.close()
    for g, w in zip(got, _want(ref, PROMPT, DECODE[:2], 8)):
        torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-4, atol=1e-4)


def _predictor_mask(ref: ReferenceModel, thr: float):
    def mask(l, pred_in):
        w = ref.w
        return (torch.relu(pred_in @ w[K.tensor(K.FC1, l)].T) @ w[K.tensor(K.FC2, l)].T) >= thr
    return mask


@pytest.mark.parametrize("split", ["all-gpu", "all-cpu", "mixed"])
def test_predicted_mode_equals_the_thresholded_reference_under_the_same_predictions(with_predictors, split):
    """Policy 'predictor' on a sparsified model reads only the predicted neurons and zeroes their h
    below the threshold: the thresholded reference masked by the same predictor decisions, and the
    pairs computed are the predicted ones."""
    ref = ReferenceModel.from_file(with_predictors, dtype=torch.float64)
    thr = 0.2
    eng = LocalEngine(EngineConfig(str(with_predictors.path), plan=_plans(ref.cfg)[split], policy="predictor",
                                   threshold=thr, prefill_chunk=8))
    try:
        got = _steps(eng, PROMPT, DECODE, 8)
        computed = _computed(eng)
    finally:
        eng.close()
    masked = DecisionReference(ref, predictor_weights(with_predictors, ref.cfg.n_layer, thr))
    errs, flips = match_rounding(masked, PROMPT + DECODE, got, _at(8), tol=1e-4)
    assert max(errs) < 1e-4, (errs, flips)
    masked.flips = flips
    want = masked.forward(PROMPT + DECODE, masked.new_cache())
    assert computed == masked.counts["predictor"].sum()
    # the threshold matters: without it (the dense reference under the same masks) the logits differ
    dense = ReferenceModel.from_file(with_predictors, thresholded=False)
    assert (want[-1] - _want(dense, PROMPT, DECODE, 8, ActivePairs(_predictor_mask(dense, thr)))[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("policy", ["gate-first", "predictor"])
def test_graph_decode_segments_equal_the_eager_step(with_predictors, policy):
    """The fixed-shape decode step (graphs.py; run eagerly on the CPU) of both modes, batched at
    different positions with a padded row: the eager step's logits, neurons and bytes."""
    plan = _plans(with_predictors.config)["split-heads"]
    runs = {}
    for graphs in (False, True):
        eng = LocalEngine(EngineConfig(str(with_predictors.path), plan=plan, policy=policy, threshold=0.2,
                                       prefill_chunk=16, max_batch=4, graphs=graphs))
        try:
            prompts = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]]
            for slot, p in enumerate(prompts):
                eng.primary.step([slot], [p], [0])
            pos, got = [len(p) for p in prompts], []
            for toks in ([11, 12, 13], [40, 41, 42]):
                got.append(eng.primary.step([0, 1, 2], [[t] for t in toks], pos))
                pos = [q + 1 for q in pos]
            st = eng.primary.stats
            runs[graphs] = (got, st.neurons, st.active_bytes, eng.cpu.stats.neurons, eng.cpu.stats.active_bytes)
            if graphs:
                assert set(eng.primary.graphs) == {1, 2, 4}  # every bucket of max_batch 4, built at the start
        finally:
            eng.close()
    for a, b in zip(runs[False][0], runs[True][0]):
        torch.testing.assert_close(torch.from_numpy(b), torch.from_numpy(a), rtol=1e-4, atol=1e-4)
    assert runs[True][1:] == runs[False][1:] and runs[True][1] > 0 and runs[True][3] > 0


def test_gate_first_reads_every_gate_row_and_only_the_active_up_and_down_rows(trained):
    """The bytes a gate-first step reads: the gate rows of all neurons of a shard, up and down rows
    of the neurons active for some token of the step (here: one token per step)."""
    cfg = trained.config
    plan = _plans(cfg)["mixed"]
    eng = LocalEngine(EngineConfig(str(trained.path), plan=plan, policy="gate-first", prefill_chunk=8))
    row = cfg.neuron_bytes // 3
    try:
        eng.primary.step([0], [[5]], [0])
        cpu, gpu = eng.cpu.stats, eng.primary.stats
        n_cpu = sum(len(lp.cpu_neurons) for lp in plan.layers)
        n_gpu = cfg.n_layer * cfg.n_ff - n_cpu
        assert gpu.active_bytes == n_gpu * row + 2 * gpu.neurons * row  # T = 1: a pair is a row
        assert cpu.active_bytes == n_cpu * row + 2 * cpu.neurons * row
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["gate-first", "oracle"])
def test_dense_prefill_of_the_cpu_shard_applies_the_thresholds(trained, policy):
    """Long prompts compute the CPU shard's neurons densely on the primary (cold.ColdRows): with the
    thresholds applied, the same logits as the thresholded reference."""
    ref = ReferenceModel.from_file(trained)
    eng = LocalEngine(EngineConfig(str(trained.path), plan=_plans(ref.cfg)["mixed"], policy=policy,
                                   prefill_chunk=32, prefill_dense_min=8))
    try:
        got = eng.primary.step([0], [PROMPT], [0])[0]
        assert eng.primary.stats.cold_neurons > 0 and eng.cpu.stats.neurons == 0
    finally:
        eng.close()
    torch.testing.assert_close(torch.from_numpy(got), ref.forward(PROMPT, ref.new_cache())[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["gate-first", "predictor"])
def test_planted_swiglu_runs_in_either_mode_over_a_solved_split(policy):
    """planted:tiny-swiglu (the llama3-8b preset's machinery: thresholds and predictors in its
    config) under a VRAM budget: the placement is solved from its thresholded activation counts,
    both executors work, and gate-first gives the thresholded reference's logits; the predicted
    mode computes the predicted pairs (the planted predictors mark ~90 % for ~50 % active)."""
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.config import resolve_plan

    spec = "planted:tiny-swiglu?dtype=f32"
    src = open_model(spec)
    ec = EngineConfig(spec, vram_budget_gib=0.0112, policy=policy, prefill_chunk=8,  # a part of the FFN
                      predictor_qtype="stored")
    plan = resolve_plan(ec, src)
    n_cpu = sum(len(lp.cpu_neurons) for lp in plan.layers)
    assert 0 < n_cpu < src.config.n_ff * src.config.n_layer
    eng = LocalEngine(EngineConfig(spec, plan=plan, policy=policy, prefill_chunk=8))
    tokens = PROMPT[:9]
    try:
        got = _steps(eng, tokens, DECODE[:3], 8)
        computed, share = _computed(eng), eng.primary.stats.as_dict()
    finally:
        eng.close()
    n_all = (len(tokens) + 3) * src.config.n_ff * src.config.n_layer
    if policy == "gate-first":
        errs, flips = match_rounding(DecisionReference(src.reference()), tokens + DECODE[:3], got,
                                     _at(8, tokens, DECODE[:3]), tol=1e-4)
        assert max(errs) < 1e-4, (errs, flips)
        assert 0.35 < computed / n_all < 0.65
    else:
        assert 0.8 < computed / n_all < 0.97
    assert share["neurons"] > 0


def test_thresholds_survive_quantization_and_run(trained, tmp_path):
    """quantize (Q4_0) keeps the thresholds in the metadata; the quantized sparsified model runs
    gate-first over a hybrid split on its blocks (the CPU kernels multiply a Q8_0-rounded x) and
    gives the thresholded reference's logits over its dequantized weights with that rounding."""
    from quant_models import KernelReference

    from powerinfer_ray.offline.quantize import quantize_file

    q4 = ModelFile(quantize_file(trained.path, tmp_path / "q4.gguf", "q4_0", progress=False))
    assert q4.config.ffn_thresholds == trained.config.ffn_thresholds and q4.config.ffn_threshold_on == "gate"
    assert q4.dtype_of(K.tensor(K.FFN_GATE, 0)) == "q4_0"
    ref = KernelReference.from_file(q4)
    eng = LocalEngine(EngineConfig(str(q4.path), plan=_plans(q4.config)["mixed"], prefill_chunk=8))
    prompt, decode = PROMPT[:8], DECODE[:2]
    try:
        assert eng.primary.policy.name == "gate-first" and eng.primary.weights.layers[0].ffn.qtype == "q4_0"
        got = _steps(eng, prompt, decode, 8)
        assert eng.cpu.stats.neurons > 0
    finally:
        eng.close()
    errs, flips = match_rounding(DecisionReference(ref), prompt + decode, got, _at(8, prompt, decode))
    assert max(errs) < 1e-5, (errs, flips)


def test_policies_without_predictors_place_neurons_in_the_predictors_bytes(tmp_path):
    """Gate-first and dense load no predictors: their placement spends the predictors' bytes on
    neurons (the same budget holds more of them on the GPU), and leaves the split cached beside
    the file, which is the predictors', alone."""
    from powerinfer_ray.model.planted import write_planted_gguf
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.config import resolve_plan, split_cache_path

    path = write_planted_gguf("tiny-swiglu?dtype=f32", tmp_path / "m.gguf", progress=False,
                              stats_dir=tmp_path / "activation", n_tokens=1000)
    src = open_model(str(path))
    gpu = {}
    for policy in ("gate-first", "dense", "predictor"):  # a budget that holds a layer's neurons without predictors
        plan = resolve_plan(EngineConfig(str(path), vram_budget_gib=0.0125, policy=policy), src)
        gpu[policy] = sum(len(lp.gpu_neurons) for lp in plan.layers)
        assert split_cache_path(str(path)).exists() == (policy == "predictor")
    assert gpu["gate-first"] == gpu["dense"] > gpu["predictor"], gpu
