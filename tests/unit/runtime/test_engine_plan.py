"""--vram-budget: the plan is solved on the fly, cached as <model>.generated.gpuidx and reused
like upstream; a budget that cannot hold the dense parts fails before loading, naming the
minimum."""
from __future__ import annotations

import shutil

import numpy as np
import torch
import pytest

from powerinfer_ray.model.costs import fitting_predictor_qtype
from powerinfer_ray.model.default import default_model_path
from powerinfer_ray.model.source import open_model
from powerinfer_ray.placement.gpuidx import gpuidx_path, read_gpuidx
from powerinfer_ray.runtime.config import GIB, SPLIT_SLACK, engine_costs
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine, resolve_plan
from powerinfer_ray.runtime.plan import Plan


@pytest.fixture()
def host(tmp_path):
    """A host where a sync is nearly free: the tiny model's neurons (1 KB each) are then worth
    placing (at 45 us the solver rightly keeps every layer's FFN on the CPU)."""
    from powerinfer_ray.placement.host import HostProfile

    path = tmp_path / "host.json"
    HostProfile(sync_us=0.01).save(path)
    return str(path)


@pytest.fixture()
def model(tmp_path):
    """The trained tiny model and its activation profile, copied (the split file lands beside)."""
    src = default_model_path()
    dst = tmp_path / src.name
    shutil.copy(src, dst)
    stats = src.parent / (src.name.split(".")[0] + ".activation.parquet")
    shutil.copy(stats, tmp_path / stats.name)
    return dst


def _budget(model, gpu_share_of_ffn: float, **ec) -> float:
    """A budget with room for everything fixed, the attention and this share of the FFN, as an engine
    of these options places it (its batch, context and prompt chunk: ``engine_costs``; its float
    predictors as Q8_0 blocks where the model does not fit whole: ``fitting_predictor_qtype``; the
    token embedding in host memory: ``embd_on_host``)."""
    c = engine_costs(EngineConfig(str(model), vram_budget_gib=1.0, **ec), open_model(model),
                     "q8_0" if gpu_share_of_ffn < 1 else None)
    return (c.fixed_bytes + c.attention_bytes + gpu_share_of_ffn * c.ffn_bytes) / GIB


def test_budget_solves_caches_and_reuses_the_split(model, host):
    cfg = open_model(model).config
    budget = _budget(model, 0.3)
    ec = EngineConfig(str(model), vram_budget_gib=budget, host_profile=host)
    plan = resolve_plan(ec)
    split = gpuidx_path(model)
    assert split.exists()
    idx = read_gpuidx(split)
    assert [np.flatnonzero(m).tolist() for m in idx.gpu_neurons] == [lp.gpu_neurons.tolist() for lp in plan.layers]
    n_gpu = sum(len(lp.gpu_neurons) for lp in plan.layers)
    assert 0 < n_gpu < cfg.n_layer * cfg.n_ff  # a real split: hot neurons on the GPU, the rest on the CPU
    assert idx.budget_bytes == EngineConfig(str(model), vram_budget_gib=budget).vram_budget_bytes
    # reused as is when it fits the budget under this engine's costs (upstream's rule, and its batch) ...
    from powerinfer_ray.placement.gpuidx import write_gpuidx

    on_gpu = np.flatnonzero(idx.gpu_neurons[0])
    held = engine_costs(ec, open_model(model), plan.predictor_qtype)
    fewer = int(SPLIT_SLACK / 2 * ec.vram_budget_bytes / held.neuron_bytes[0])  # within the unused share allowed
    assert 0 < fewer < len(on_gpu)
    idx.gpu_neurons[0][on_gpu[:fewer]] = False
    write_gpuidx(split, idx.gpu_neurons, idx.vram_capacity, idx.budget_bytes, idx.gpu_attention)
    assert resolve_plan(ec).layers[0].gpu_neurons.size == len(on_gpu) - fewer
    # ... not when it does not: every neuron of layer 0 on the GPU overflows a budget solved full
    idx.gpu_neurons[0][:] = True
    write_gpuidx(split, idx.gpu_neurons, idx.vram_capacity, idx.budget_bytes, idx.gpu_attention)
    assert [lp.gpu_neurons.tolist() for lp in resolve_plan(ec).layers] == [lp.gpu_neurons.tolist() for lp in plan.layers]
    # ... and unless --reset-gpu-index, which re-solves and rewrites it
    idx.gpu_neurons[0][on_gpu[: len(on_gpu) // 2]] = False
    write_gpuidx(split, idx.gpu_neurons, idx.vram_capacity, idx.budget_bytes, idx.gpu_attention)
    again = resolve_plan(EngineConfig(str(model), vram_budget_gib=budget, reset_gpu_index=True, host_profile=host))
    assert [lp.gpu_neurons.tolist() for lp in again.layers] == [lp.gpu_neurons.tolist() for lp in plan.layers]
    # --disable-gpu-index neither reads nor writes
    split.unlink()
    resolve_plan(EngineConfig(str(model), vram_budget_gib=budget, disable_gpu_index=True, host_profile=host))
    assert not split.exists()


def test_a_cached_split_loads_without_the_solver(model, host):
    """A load that reuses the cached split imports no cvxpy (its import alone takes seconds)."""
    import subprocess
    import sys

    budget = _budget(model, 0.3)
    solved = resolve_plan(EngineConfig(str(model), vram_budget_gib=budget, host_profile=host))
    code = ("import sys; from powerinfer_ray.runtime.engine import EngineConfig, resolve_plan; "
            f"p = resolve_plan(EngineConfig({str(model)!r}, vram_budget_gib={budget!r}, host_profile={host!r})); "
            "print(sum(len(lp.gpu_neurons) for lp in p.layers), 'cvxpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(sum(len(lp.gpu_neurons) for lp in solved.layers)), "False"]


def test_sync_cost_keeps_small_layers_whole(model):
    """At the default 45 us per sync, none of the tiny model's layers is worth splitting: each
    goes whole to the GPU (no sync then) or stays whole on the CPU. With room for 30 % of the FFN
    bytes, the whole layers that fit go to the GPU."""
    cfg = open_model(model).config
    plan = resolve_plan(EngineConfig(str(model), vram_budget_gib=_budget(model, 0.3), disable_gpu_index=True))
    whole = [len(lp.gpu_neurons) == cfg.n_ff for lp in plan.layers]
    assert all(w or len(lp.gpu_neurons) == 0 for w, lp in zip(whole, plan.layers))
    assert sum(whole) == int(0.3 * cfg.n_layer)  # as many whole layers as fit


def test_hotter_neurons_go_to_the_gpu(model, host):
    from powerinfer_ray.offline.solve import load_counts

    counts, _ = load_counts(model.parent / (model.name.split(".")[0] + ".activation.parquet"))
    plan = resolve_plan(EngineConfig(str(model), vram_budget_gib=_budget(model, 0.3), host_profile=host))
    share = plan.gpu_activation_share(counts)
    gpu_frac = sum(len(lp.gpu_neurons) for lp in plan.layers) / sum(len(c) for c in counts)
    assert share > gpu_frac + 0.2  # the solver picked the hot ones: far more activations than neurons


def test_a_split_cached_for_a_smaller_batch_is_solved_again_for_a_larger_one(model, host):
    """A CUDA primary's placement reserves the KV cache and the primary's workspace of the engine's
    largest batch (``engine_costs``: both grow with max_batch; planned here, no engine runs): a split
    solved to fill a budget at batch 1 does not fit an engine of batch 8 at that budget, which solves
    its own (within the budget at batch 8), while an engine of batch 1 reuses the cached one."""
    from powerinfer_ray.runtime.config import split_bytes
    from powerinfer_ray.runtime.workspace import workspace_bytes

    cfg = open_model(model).config
    b1, b8 = (engine_costs(EngineConfig(str(model), max_batch=b, device="cuda"), open_model(model)) for b in (1, 8))
    assert b8.kv_group_bytes[0] > b1.kv_group_bytes[0] and b8.workspace_bytes > b1.workspace_bytes
    assert b8.workspace_bytes == workspace_bytes(cfg, 8, 1024, min(cfg.n_ctx, 4096), 4 if cfg.float_dtype == "f32" else 2)
    budget = _budget(model, 0.3, max_batch=1, device="cuda")
    # at this budget the default prompt chunk is smaller (resolve_prefill_chunk): the costs the plans hold
    first = resolve_plan(EngineConfig(str(model), vram_budget_gib=budget, max_batch=1, device="cuda", host_profile=host))
    b1, b8 = (engine_costs(EngineConfig(str(model), max_batch=b, device="cuda", vram_budget_gib=budget),
                           open_model(model), first.predictor_qtype) for b in (1, 8))
    masks = lambda p: [np.isin(np.arange(len(lp.gpu_neurons) + len(lp.cpu_neurons)), lp.gpu_neurons)  # noqa: E731
                       for lp in p.layers]
    assert split_bytes(b8, masks(first)) > budget * GIB >= split_bytes(b1, masks(first))
    again = resolve_plan(EngineConfig(str(model), vram_budget_gib=budget, max_batch=1, device="cuda", host_profile=host))
    assert [lp.gpu_neurons.tolist() for lp in again.layers] == [lp.gpu_neurons.tolist() for lp in first.layers]
    larger = resolve_plan(EngineConfig(str(model), vram_budget_gib=budget, max_batch=8, device="cuda", host_profile=host))
    held = engine_costs(EngineConfig(str(model), max_batch=8, device="cuda", vram_budget_gib=budget), open_model(model),
                        larger.predictor_qtype)
    assert split_bytes(held, masks(larger), [len(lp.gpu_groups) for lp in larger.layers]) <= budget * GIB
    assert sum(map(len, (lp.gpu_neurons for lp in larger.layers))) < sum(map(len, (lp.gpu_neurons for lp in first.layers)))


def test_too_small_budget_fails_before_loading_and_names_the_minimum(model):
    """The minimum is that of predictors held as the finest block type the budget needs
    (Q4_0 at so small a budget), which the message says."""
    src = open_model(model)
    pq = fitting_predictor_qtype(src, min(src.config.n_ctx, 4096), 8, int(0.001 * GIB))
    c = engine_costs(EngineConfig(str(model)), src, pq)
    with pytest.raises(ValueError) as exc:
        LocalEngine(EngineConfig(str(model), vram_budget_gib=0.001))
    msg = str(exc.value)
    assert pq == "q4_0" and "held as q4_0" in msg, msg
    assert "GiB" in msg and f"{c.min_budget_bytes(True) / GIB:.3f}"[:5] in msg, msg


def test_prefill_chunk_defaults_by_device_budget_and_checks_values():
    """1024 prompt tokens per step on a CUDA primary (its prefill streams the CPU shard once per
    chunk), fewer under a budget too small for that chunk's activations (at most 1/25 of it: the
    largest chunk that fits, computed here from the workspace's own bound), 64 on the CPU; an
    explicit value wins; a chunk below 1 is refused."""
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.engine import resolve_prefill_chunk
    from powerinfer_ray.runtime.workspace import prefill_bytes

    cfg = open_model("planted:llama2-13b?dtype=q4_0").config
    assert resolve_prefill_chunk(EngineConfig("m.gguf"), "cuda") == 1024
    assert resolve_prefill_chunk(EngineConfig("m.gguf", vram_budget_gib=16), "cuda", cfg) == 1024
    assert resolve_prefill_chunk(EngineConfig("m.gguf"), "cpu") == 64
    assert resolve_prefill_chunk(EngineConfig("m.gguf", vram_budget_gib=4), "cpu", cfg) == 64
    for gib in (2, 4, 8):
        ec = EngineConfig("m.gguf", vram_budget_gib=gib)
        chunk, room = resolve_prefill_chunk(ec, "cuda", cfg), gib * GIB / 25
        need = {c: prefill_bytes(cfg, c, ec.max_batch, 4096, 2) for c in (128, 256, 512, 1024)}
        assert chunk == 128 or need[chunk] <= room, (gib, chunk)
        assert all(need[c] > room for c in need if c > chunk), (gib, chunk, need, room)
    assert resolve_prefill_chunk(EngineConfig("m.gguf", vram_budget_gib=4), "cuda", cfg) == 256
    assert resolve_prefill_chunk(EngineConfig("m.gguf", prefill_chunk=16, vram_budget_gib=1), "cuda", cfg) == 16
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        resolve_prefill_chunk(EngineConfig("m.gguf", prefill_chunk=0), "cpu")


def test_hot_first_cpu_rows_give_the_same_logits():
    """The engine's plan orders each layer's CPU rows by activation count (``Plan.hot_first``);
    the CPU shard, its mask and the predictor's rows follow that order, so every step's logits
    equal those of an engine given the same split in ascending ids (up to fp32 summation order)."""
    from powerinfer_ray.runtime.config import activation_counts

    spec = "planted:tiny"
    src = open_model(spec)
    counts = activation_counts(src, spec)[0]
    ec = dict(policy="predictor", max_batch=1, prefill_chunk=8)
    by_id = Plan.hottest(src.config, 0.3, counts)  # the same split, CPU rows in ascending ids
    prompt, logits, plans = list(range(3, 19)), {}, {}
    for order, kw in (("id", dict(plan=by_id)), ("hot", dict(gpu_fraction=0.3))):
        eng = LocalEngine(EngineConfig(spec, **ec, **kw))
        try:
            plans[order] = eng.primary.plan
            steps = [eng.primary.step([0], [prompt[i:i + 8]], [i])[0] for i in (0, 8)]
            steps += [eng.primary.step([0], [[t]], [len(prompt) + i])[0] for i, t in enumerate(range(40, 48))]
            logits[order] = np.stack(steps)
            assert eng.cpu.stats.neurons > 0  # the CPU rows took part
        finally:
            eng.close()
    for l, (a, b) in enumerate(zip(plans["id"].layers, plans["hot"].layers)):
        assert np.array_equal(a.gpu_neurons, b.gpu_neurons)
        assert np.array_equal(a.cpu_neurons, np.sort(a.cpu_neurons))
        assert np.array_equal(np.sort(b.cpu_neurons), a.cpu_neurons)  # the same neurons
        assert np.all(np.diff(counts[l][b.cpu_neurons]) <= 0)  # hottest first
        assert not np.array_equal(a.cpu_neurons, b.cpu_neurons)  # reordered: the test is not vacuous
    np.testing.assert_allclose(logits["hot"], logits["id"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_predictors_quantized_at_load_equal_a_file_that_stores_them_so(tmp_path, qtype):
    """predictor_qtype on f16 predictors: the primary holds exactly the blocks of a file that
    stores those predictors as ``qtype`` (gguf's quantizer), and an engine split between the
    primary and the CPU executor computes every step's logits as one over that file does (a
    wrong block or a quantizer bug moves them by far more than the fp32 summation order)."""
    from powerinfer_ray.model.gguf_writer import LazyTensor, write_model
    from powerinfer_ray.model.quants import quantize
    from powerinfer_ray.model.tiny import tiny_config, tiny_weights

    cfg = tiny_config("llama-reglu", dtype="f16", predictor_rank=64, n_layer=2)
    w = tiny_weights(cfg, seed=2)
    f16 = write_model(tmp_path / "f16.gguf", cfg, w)
    blocks = {n: LazyTensor(tuple(t.shape), qtype, lambda t=t: quantize(t.to(torch.float16), qtype))  # as f16 stores it
              for n, t in w.items() if n.split(".")[-2] in ("fc1", "fc2")}
    stored = write_model(tmp_path / "stored.gguf", cfg, {**w, **blocks})
    got = {}
    for path, pq in ((f16, qtype), (stored, "stored")):
        eng = LocalEngine(EngineConfig(str(path), gpu_fraction=0.5, device="cpu", predictor_qtype=pq, max_batch=2))
        try:
            assert eng.cpu is not None and eng.primary.plan.predictor_qtype == (qtype if pq == qtype else None)
            held = [(lw.fc_qtypes, lw.fc1.clone(), lw.fc2.clone()) for lw in eng.primary.weights.layers]
            steps = [eng.primary.step([0], [[1, 5, 9, 2, 7]], [0])[0], eng.primary.step([0], [[4]], [5])[0]]
            got[pq] = held, [np.array(s, copy=True) for s in steps]
        finally:
            eng.close()
    for (qa, a1, a2), (qb, b1, b2) in zip(got[qtype][0], got["stored"][0]):
        assert qa == qb == (qtype, qtype)
        assert torch.equal(a1, b1) and torch.equal(a2, b2)
    for a, b in zip(got[qtype][1], got["stored"][1]):  # the same kernels on the same blocks (fp32 sums in
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # another order where threads split them)
