"""Our split files against upstream PowerInfer's check (llama.cpp's check_vram_allocable: the
file's split.vram_capacity <= the VRAM left for FFN neurons once attention, predictors, norms,
the output head and the KV cache are offloaded), and the split cache reading both meanings of
split.vram_capacity: upstream's FFN bytes and our old whole budget."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from quant_models import write_upstream_int4

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.costs import model_costs
from powerinfer_ray.model.gguf_config import expected_shapes
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.qtypes import tensor_bytes
from powerinfer_ray.model.source import open_model
from powerinfer_ray.model.tiny import tiny_config, tiny_weights
from powerinfer_ray.placement import GIB, HostProfile, gpuidx_path, read_gpuidx, solve_placement, write_gpuidx
from powerinfer_ray.placement.gpuidx import GpuIndexError, upstream_ffn_budget, write_split
from powerinfer_ray.runtime.config import EngineConfig, engine_n_ctx, placement_inputs, resolve_plan, split_bytes

UPSTREAM_13B_16GIB = 5714653184  # split.vram_capacity of the split upstream's main solved for the planted
# Llama-2-13B f16 file at --vram-budget 16 (issue 34): the 5449.9 MiB it left for FFN neurons


def _bytes(mf: ModelFile) -> dict[str, int]:
    return {n: int(t.n_bytes) for n, t in mf.tensors.items()}


def _upstream_room(mf: ModelFile, budget: int) -> int | None:
    cfg = mf.config
    return upstream_ffn_budget(_bytes(mf), cfg.n_layer, cfg.n_head_kv * cfg.head_dim, budget)


def _loaded_ffn_bytes(mf: ModelFile, masks) -> int:  # noqa: ANN001
    """What upstream copies to the GPU for a split (slice_ffn_mat_to_gpu): per GPU neuron its rows
    of ffn_gate, ffn_up and ffn_down_t, at the file's row sizes."""
    cfg = mf.config
    per_row = [sum(mf.tensors[K.tensor(t, l)].n_bytes for t in (K.FFN_GATE, K.FFN_UP, K.FFN_DOWN_T)
                   if mf.has(K.tensor(t, l))) // cfg.n_ff for l in range(cfg.n_layer)]
    return sum(int(np.count_nonzero(m)) * r for m, r in zip(masks, per_row))


def _write(path, kind: str):  # noqa: ANN001, ANN202
    """A tiny sparse model with an output head: f16 and Q4_0 by our writer, or upstream's INT4
    layout (Q4_0, Q6_K head, PWRI magic) by gguf-py."""
    if kind == "upstream-q4_0":
        cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=64, tied_output=False, dtype="q4_0")
        write_upstream_int4(path, cfg, np.random.default_rng(0))
        return path
    cfg = tiny_config("llama-gqa", dtype=kind, predictor_rank=32, tied_output=False)
    return write_model(path, cfg, tiny_weights(cfg, seed=1))


@pytest.fixture()
def host(tmp_path):
    """A nearly free sync, so that the solver splits the tiny model's layers."""
    path = tmp_path / "host.json"
    HostProfile(sync_us=0.01).save(path)
    return str(path)


def _budget(mf: ModelFile, attention: float, ffn: float) -> int:
    """The budget holding the fixed parts, a share of attention (with its KV cache) and of the FFN,
    at the engine's default context and batch."""
    c = model_costs(mf, engine_n_ctx(EngineConfig(str(mf.path)), mf.config), EngineConfig(str(mf.path)).max_batch)
    return int(c.fixed_bytes + attention * c.attention_bytes + ffn * c.ffn_bytes)


# --- upstream's FFN budget --------------------------------------------------------------------
def test_upstream_ffn_budget_by_hand_f16(tmp_path):
    """n_embd 64, 4 heads, 2 KV heads of 16, 2 layers, n_ff 256, predictor rank 32, 258 tokens, f16
    matrices, f32 norms; upstream's main reserves K and V for 512 tokens in f16."""
    mf = ModelFile(_write(tmp_path / "m.gguf", "f16"))
    attention = 64 * 4 + (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64) * 2  # attn_norm, q, k, v, o per layer
    predictors = (32 * 64 + 256 * 32) * 2  # fc1, fc2
    ffn_norm, output = 64 * 4, 258 * 64 * 2 + 64 * 4  # output and output_norm
    dense = 2 * (attention + predictors + ffn_norm) + output
    kv = 32 * 2 * 512 * 2  # one of K, V: n_embd_gqa x n_layer x n_ctx x f16
    assert dense == 124416
    assert _upstream_room(mf, 1 << 20) == (1 << 20) - dense - 2 * kv
    assert _upstream_room(mf, dense + 2 * kv) == 0
    assert _upstream_room(mf, dense + kv + 100) == 100  # K reserved, V does not fit: upstream goes on
    assert _upstream_room(mf, dense + 100) == 100  # no KV cache fits
    assert _upstream_room(mf, dense - 1) is None  # the dense part does not fit: no split applied


def test_upstream_ffn_budget_by_hand_upstream_int4(tmp_path):
    """Upstream's INT4 layout: Q4_0 matrices (18 bytes per 32 weights), the Q6_K head (210 bytes
    per 256), f32 norms; n_embd 256, 4 KV heads of 64, predictor rank 64."""
    mf = ModelFile(_write(tmp_path / "u.gguf", "upstream-q4_0"))
    q4 = lambda rows, cols: rows * cols // 32 * 18  # noqa: E731
    attention = 256 * 4 + 4 * q4(256, 256)
    predictors = q4(64, 256) + q4(256, 64)
    dense = 2 * (attention + predictors + 256 * 4) + 258 * 256 // 256 * 210 + 256 * 4
    kv = 256 * 2 * 512 * 2
    assert dense == 391076
    assert _upstream_room(mf, 4 << 20) == (4 << 20) - dense - 2 * kv


@pytest.mark.parametrize("spec, budget_gib, output", [
    ("planted:llama2-13b?dtype=f16", 16, None),
    ("planted:llama2-13b?dtype=q4_0", 4, "q6_k"),  # upstream's quantize writes the head in Q6_K
    ("planted:llama2-13b?dtype=q4_0", 4, None),  # ours: Q8_0
])
def test_our_split_of_the_13b_shape_passes_upstreams_check(tmp_path, spec, budget_gib, output):
    """The headline budgets: upstream's FFN room for the 13B f16 shape at 16 GiB is the figure its
    own split file holds; the split our solver writes for the benchmark's engine (prompt 64 + 128
    generated, batch 1, the planted statistics) holds its true FFN bytes, within that room."""
    src = open_model(spec)
    cfg = src.config
    kinds = {n: (output if output and n == K.global_tensor(K.OUTPUT) else src.dtype_of(n)) for n in expected_shapes(cfg)}
    sizes = {n: tensor_bytes(kinds[n], shape) for n, shape in expected_shapes(cfg).items()}
    room = upstream_ffn_budget(sizes, cfg.n_layer, cfg.n_head_kv * cfg.head_dim, budget_gib * GIB)
    if spec.endswith("f16"):
        assert room == UPSTREAM_13B_16GIB
    costs = model_costs(src, 64 + 128 + 8, 1)
    counts, n_tokens = src.activation_counts(100_000)
    placement = solve_placement(counts, n_tokens, costs, budget_gib * GIB, HostProfile())
    write_split(tmp_path / "s.gpuidx", placement, costs)
    split = read_gpuidx(tmp_path / "s.gpuidx", costs.n_ff)
    per_row = [sum(sizes[K.tensor(t, l)] for t in (K.FFN_GATE, K.FFN_UP, K.FFN_DOWN_T)) // cfg.n_ff
               for l in range(cfg.n_layer)]
    assert split.vram_capacity == sum(int(m.sum()) * r for m, r in zip(split.gpu_neurons, per_row))
    assert 0.5 * room < split.vram_capacity <= room  # upstream applies it, and it fills most of the room
    assert split.budget_bytes == budget_gib * GIB and split.gpu_attention.all()


def test_unknown_tensors_are_named():
    with pytest.raises(GpuIndexError, match="'blk.0.ffn_mystery.weight'.*no offloading level"):
        upstream_ffn_budget({"blk.0.ffn_mystery.weight": 10}, 1, 8, GIB)


# --- the split we write -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["f16", "q4_0", "upstream-q4_0"])
def test_our_split_file_passes_upstreams_check(tmp_path, host, kind):
    """The split the engine solves and caches for a budget holds the bytes upstream will load for
    it (never less), within upstream's FFN room when our plan keeps attention and predictors on
    the GPU, as it does above the budget where all attention fits; when attention leaves the GPU
    our FFN bytes may exceed upstream's room (upstream then solves its own split)."""
    model = _write(tmp_path / f"m.{kind}.gguf", kind)
    mf = ModelFile(model)
    passed = []
    for attention, ffn in ((1.0, 0.5), (1.0, 0.9), (0.5, 0.5)):
        budget = _budget(mf, attention, ffn)
        plan = resolve_plan(EngineConfig(str(model), vram_budget_gib=budget / GIB, host_profile=host,
                                         reset_gpu_index=True))
        split = read_gpuidx(gpuidx_path(model), [mf.config.n_ff] * mf.config.n_layer)
        assert split.vram_capacity == _loaded_ffn_bytes(mf, split.gpu_neurons)
        assert split.budget_bytes == budget
        assert [np.flatnonzero(g).tolist() for g in split.gpu_attention] == [lp.gpu_groups.tolist() for lp in plan.layers]
        if split.gpu_attention.all():
            assert 0 < split.vram_capacity <= _upstream_room(mf, budget)
            passed.append(budget)
    assert len(passed) >= 2  # both budgets that hold all attention were checked
    # the old value, the whole budget, fails upstream's check at that budget
    assert passed[0] > _upstream_room(mf, passed[0])


# --- reading a cached split ---------------------------------------------------------------------
@pytest.fixture()
def tiny(tmp_path):
    return ModelFile(_write(tmp_path / "m.gguf", "f16"))


def _resolve(mf: ModelFile, budget: int, host: str, caplog, **kw):  # noqa: ANN001, ANN202
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="powerinfer_ray.runtime.config"):
        plan = resolve_plan(EngineConfig(str(mf.path), vram_budget_gib=budget / GIB, host_profile=host, **kw))
    return plan, caplog.text


def _masks(mf: ModelFile, share: float) -> list[np.ndarray]:
    return [np.arange(mf.config.n_ff) % int(1 / share) == l for l in range(mf.config.n_layer)]


def _need(mf: ModelFile, masks, groups, host: str) -> int:  # noqa: ANN001
    """The GPU bytes of a split at the default engine's costs (batch, context, workspace)."""
    ec = EngineConfig(str(mf.path), vram_budget_gib=1.0, host_profile=host)
    costs = placement_inputs(ec, open_model(str(mf.path)), None)[0]
    return int(np.ceil(split_bytes(costs, masks, [int(g.sum()) for g in groups])))


def test_our_cached_split_is_our_plan(tiny, host, caplog):
    """Our keys restore the plan (attention groups included) at the budget it fills; a smaller
    budget re-solves, and so does a larger one, in which it would leave room unused while neurons
    stay on the CPU."""
    masks, groups = _masks(tiny, 0.25), np.array([[True, False], [False, True]])
    budget = _need(tiny, masks, groups, host)
    for other in (budget - 1, int(budget * 1.02)):
        write_gpuidx(gpuidx_path(tiny.path), masks, 1, budget_bytes=budget, gpu_attention=groups)
        plan, log = _resolve(tiny, budget, host, caplog)
        assert [lp.gpu_neurons.tolist() for lp in plan.layers] == [np.flatnonzero(m).tolist() for m in masks]
        assert [lp.cpu_groups.tolist() for lp in plan.layers] == [[1], [0]]
        assert "using cached split" in log and "solved for" in log
        plan, log = _resolve(tiny, other, host, caplog)
        assert "re-solving" in log and read_gpuidx(gpuidx_path(tiny.path)).budget_bytes == other
        assert ("unused" in log) is (other > budget)


def test_a_split_cached_for_a_longer_context_is_solved_again_for_a_shorter_one(tiny, host, caplog):
    """An engine at a long context solves and caches its split; one at a short context would
    leave the long context's KV cache unused in the budget: it solves again, and puts more of
    the FFN on the GPU."""
    budget = _budget(tiny, 1.0, 0.5)
    long_ctx = engine_n_ctx(EngineConfig(str(tiny.path)), tiny.config)
    short, log = _resolve(tiny, budget, host, caplog, n_ctx=8, reset_gpu_index=True)
    long, log = _resolve(tiny, budget, host, caplog, n_ctx=long_ctx)
    assert "re-solving" in log and "needs" in log  # the short context's split does not fit the long one
    again, log = _resolve(tiny, budget, host, caplog, n_ctx=8)
    assert "unused" in log and "re-solving" in log
    gpu = lambda plan: sum(len(lp.gpu_neurons) for lp in plan.layers)  # noqa: E731
    assert gpu(again) == gpu(short) > gpu(long)


def test_upstreams_split_is_checked_as_upstream_checks_it(tiny, host, caplog):
    """Upstream's file (PWRI magic) holds the FFN budget it solved for: used where upstream would
    use it, and re-solved at a budget whose FFN room is smaller, though the whole budget exceeds
    the capacity (the whole-budget reading would take a split solved for 16 GiB at 8)."""
    masks = _masks(tiny, 0.5)
    budget = _budget(tiny, 1.0, 1.0)
    capacity = _upstream_room(tiny, budget)
    assert _loaded_ffn_bytes(tiny, masks) <= capacity
    write_gpuidx(gpuidx_path(tiny.path), masks, capacity)  # upstream's keys only
    with open(gpuidx_path(tiny.path), "r+b") as f:
        f.write(b"PWRI")  # as upstream's export_split does
    plan, log = _resolve(tiny, budget, host, caplog)
    assert [lp.gpu_neurons.tolist() for lp in plan.layers] == [np.flatnonzero(m).tolist() for m in masks]
    assert "FFN bytes (upstream's meaning)" in log and "using cached split" in log
    assert all(lp.cpu_groups.size == 0 for lp in plan.layers)  # upstream keeps attention on the GPU
    smaller = budget - 1000
    assert capacity <= smaller and _upstream_room(tiny, smaller) < capacity
    _, log = _resolve(tiny, smaller, host, caplog)
    assert "FFN bytes (upstream's meaning)" in log and "re-solving" in log


def test_the_solve_commands_old_split_holds_ffn_bytes(tiny, host, caplog):
    """`powerinfer-ray solve` wrote the FFN bytes before our keys: read with upstream's meaning."""
    masks = _masks(tiny, 0.5)
    write_gpuidx(gpuidx_path(tiny.path), masks, _loaded_ffn_bytes(tiny, masks))
    plan, log = _resolve(tiny, _budget(tiny, 1.0, 0.6), host, caplog)
    assert "FFN bytes (upstream's meaning)" in log and "using cached split" in log
    assert [lp.gpu_neurons.tolist() for lp in plan.layers] == [np.flatnonzero(m).tolist() for m in masks]


def test_our_old_whole_budget_split_is_read_as_such(tiny, host, caplog):
    """Our files before the FFN-bytes fix held the whole budget: reused for that budget or a larger
    one, re-solved below it."""
    budget = _budget(tiny, 1.0, 0.5)
    masks = _masks(tiny, 0.25)
    write_gpuidx(gpuidx_path(tiny.path), masks, budget)
    plan, log = _resolve(tiny, budget, host, caplog)
    assert [lp.gpu_neurons.tolist() for lp in plan.layers] == [np.flatnonzero(m).tolist() for m in masks]
    assert "our old whole-budget value" in log and "using cached split" in log
    _, log = _resolve(tiny, budget - 1, host, caplog)
    assert "our old whole-budget value" in log and "re-solving" in log
