"""Placement byte costs are the bytes the primary executor holds: for every float dtype the VRAM
budget holds when measured, and for Q8_0 / Q4_0 the costs are the file's compressed sizes."""
from __future__ import annotations

import dataclasses
import numpy as np
import pytest
from quant_models import write_upstream_int4

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.costs import model_costs
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.planted import write_planted_gguf
from powerinfer_ray.model.tiny import tiny_config, tiny_weights
from powerinfer_ray.placement.problem import InfeasibleBudgetError
from powerinfer_ray.runtime.config import GIB, EngineConfig, engine_n_ctx, resolve_plan
from powerinfer_ray.runtime.engine import LocalEngine


def _tiny(path, dtype: str):
    """A tiny sparse model whose predictors are a large share of its bytes (rank 128 for n_ff 256);
    'upstream-q4_0': upstream's INT4 layout written by gguf-py (its Q6_K head held in f16);
    'falcon-fused-q4_0': a planted Falcon in llama.cpp's layout, q/k/v fused, f16 predictors."""
    if dtype == "falcon-fused-q4_0":  # llama.cpp's Falcon layout (one attn_qkv), f16 predictors
        return write_planted_gguf("tiny-falcon?dtype=q4_0&qkv=fused&pred_dtype=f16", path, progress=False)
    if dtype == "upstream-q4_0":
        cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=128, tied_output=False, dtype="q4_0")
        write_upstream_int4(path, cfg, np.random.default_rng(0))
        return path
    cfg = tiny_config("llama-reglu", dtype=dtype, predictor_rank=128, tied_output=False)
    return write_model(path, cfg, tiny_weights(cfg, seed=1))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "upstream-q4_0", "falcon-fused-q4_0"])
@pytest.mark.parametrize("where", ["minimum", "half-ffn"])
def test_the_planned_bytes_are_the_bytes_held(tmp_path, dtype, where):
    """At 1 % over the minimum budget the solver reports, and with room for the attention and
    half the FFN, the primary (holding the model's own dtype, as a GPU primary
    does: Q8_0 / Q4_0 matrices as their blocks, the rest in f16) holds exactly what the costs say
    it holds (all but the norms, which it keeps outside its shards), and with the workspace the
    costs reserve, stays within the budget + 2 %."""
    path = _tiny(tmp_path / f"m.{dtype}.gguf", dtype)
    mf = ModelFile(path)
    cfg = mf.config
    c = model_costs(mf, engine_n_ctx(EngineConfig(str(path)), cfg), 2)
    ec = dict(disable_gpu_index=True, device="cpu", dtype=cfg.float_dtype, max_batch=2)
    with pytest.raises(InfeasibleBudgetError) as exc:
        resolve_plan(EngineConfig(str(path), vram_budget_gib=1e-6, **ec))
    low = exc.value.min_budget_bytes
    budget = low * 1.01 if where == "minimum" else c.fixed_bytes + c.attention_bytes + c.ffn_bytes / 2
    engine = LocalEngine(EngineConfig(str(path), vram_budget_gib=budget / GIB, **ec))
    try:
        held = engine.primary.weight_bytes()
        plan = engine.primary.plan
    finally:
        engine.close()
    assert plan.embd_on_host == (not cfg.tied_output)  # under a budget an untied embedding is not counted
    c = model_costs(mf, engine_n_ctx(EngineConfig(str(path)), cfg), 2, predictor_qtype=plan.predictor_qtype,
                    embd_on_host=True)
    placed = sum(len(lp.gpu_neurons) * c.neuron_bytes[l] + len(lp.gpu_groups) * c.attn_unit_bytes[l]
                 for l, lp in enumerate(plan.layers))
    if where == "half-ffn":
        assert all(len(lp.gpu_groups) == cfg.n_head_kv for lp in plan.layers)
    norms = sum(int(t.n_bytes) for name, t in mf.tensors.items() if "norm" in name)  # f32 weights (+ biases)
    assert held == c.dense_bytes + sum(c.predictor_bytes) + placed - norms
    assert held + c.workspace_bytes <= 1.02 * budget, (held, c.workspace_bytes, budget)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_costs_are_the_files_tensor_sizes(tmp_path, qtype):
    cfg = tiny_config("llama-reglu", dtype=qtype, predictor_rank=32, tied_output=False)
    mf = ModelFile(write_model(tmp_path / "m.gguf", cfg, tiny_weights(cfg)))
    c = model_costs(mf, 128, 2)
    assert c == model_costs(cfg, 128, 2)  # the config alone gives the same costs
    _assert_file_sizes(mf, c, output_bytes=mf.tensors["output.weight"].n_bytes)
    embd = int(mf.tensors[K.global_tensor(K.TOKEN_EMBD)].n_bytes)  # in host memory: not the budget's
    assert model_costs(mf, 128, 2, embd_on_host=True) == dataclasses.replace(c, dense_bytes=c.dense_bytes - embd)
    tied = tiny_config("llama-reglu", dtype=qtype, predictor_rank=32, tied_output=True)  # the head: on the GPU
    assert model_costs(tied, 128, 2, embd_on_host=True) == model_costs(tied, 128, 2)
    assert c.kv_group_bytes[0] == 2 * cfg.head_dim * 128 * 3 * 2  # f16 cache, 2 + 1 sequences


def test_upstream_int4_costs(tmp_path):
    """Upstream's INT4 file: Q4_0 blocks, and the Q6_K output head in f16 (dequantized at load)."""
    cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=64, tied_output=False, dtype="q4_0")
    write_upstream_int4(tmp_path / "u.gguf", cfg, np.random.default_rng(0))
    mf = ModelFile(tmp_path / "u.gguf")
    _assert_file_sizes(mf, model_costs(mf, 128, 2), output_bytes=cfg.n_vocab * cfg.n_embd * 2)


def _assert_file_sizes(mf: ModelFile, c, output_bytes: int) -> None:
    cfg, nb = mf.config, lambda n: int(mf.tensors[n].n_bytes)  # noqa: E731
    for l in range(cfg.n_layer):
        t = lambda tmpl: nb(K.tensor(tmpl, l))  # noqa: E731
        assert c.neuron_bytes[l] * cfg.n_ff == t(K.FFN_UP) + t(K.FFN_GATE) + t(K.FFN_DOWN_T)
        assert c.attn_group_bytes[l] * cfg.n_head_kv == t(K.ATTN_Q) + t(K.ATTN_K) + t(K.ATTN_V) + t(K.ATTN_OUT)
        assert c.predictor_bytes[l] == t(K.FC1) + t(K.FC2)
    norms = sum(nb(n) for n in mf.tensors if n.endswith("norm.weight"))
    assert c.dense_bytes == nb(K.global_tensor(K.TOKEN_EMBD)) + output_bytes + norms


@pytest.mark.parametrize("want", [None, "q8_0", "q4_0"])
def test_float_predictors_are_quantized_when_the_budget_needs_it(tmp_path, want):
    """f16 predictors in a Q4_0 file: at a budget that holds the whole model they stay f16; at one
    that holds them and all attention with a quarter of the FFN, the primary holds them as Q8_0
    blocks (their saved bytes hold hot neurons); with room for the attention only once they are
    Q4_0, as Q4_0 blocks. The bytes held are exactly those the costs planned, and all attention
    stays on the primary."""
    path = _tiny(tmp_path / "f.gguf", "falcon-fused-q4_0")
    mf = ModelFile(path)
    cfg = mf.config
    n_ctx = engine_n_ctx(EngineConfig(str(path)), cfg)
    costs = {q: model_costs(mf, n_ctx, 2, predictor_qtype=q, embd_on_host=True) for q in (None, "q8_0", "q4_0")}
    room = {q: c.fixed_bytes + c.attention_bytes for q, c in costs.items()}
    assert room[None] > room["q8_0"] > room["q4_0"]
    budget = {None: costs[None].total_bytes, "q8_0": room[None] + costs[None].ffn_bytes // 4,
              "q4_0": (room["q8_0"] + room["q4_0"]) // 2}[want]
    ec = EngineConfig(str(path), vram_budget_gib=budget / GIB, disable_gpu_index=True, device="cpu", dtype="f16",
                      max_batch=2)
    engine = LocalEngine(ec)
    try:
        held, plan, layers = engine.primary.weight_bytes(), engine.primary.plan, engine.primary.weights.layers
    finally:
        engine.close()
    assert plan.predictor_qtype == want
    for l, lw in enumerate(layers):  # fc2's rows (r weights) are blocks only when r is a multiple of 32
        assert lw.fc_qtypes == (want, want if cfg.predictor_ranks[l] % 32 == 0 else None)
    assert all(len(lp.gpu_groups) == cfg.n_head_kv for lp in plan.layers)
    c = costs[want]
    placed = sum(len(lp.gpu_neurons) * c.neuron_bytes[l] + len(lp.gpu_groups) * c.attn_unit_bytes[l]
                 for l, lp in enumerate(plan.layers))
    norms = sum(int(t.n_bytes) for name, t in mf.tensors.items() if "norm" in name)
    assert held == c.dense_bytes + sum(c.predictor_bytes) + placed - norms
    assert held + c.workspace_bytes <= 1.02 * budget
    if want == "q8_0":  # the bytes saved hold neurons that float predictors leave on the CPU
        stored = resolve_plan(dataclasses.replace(ec, predictor_qtype="stored"))
        assert sum(map(len, (lp.gpu_neurons for lp in plan.layers))) > sum(map(len, (lp.gpu_neurons for lp in stored.layers)))
