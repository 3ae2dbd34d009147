"""The VRAM budget measured on CUDA with torch's peak counters: quantized models at batch 1, an f16
model at its largest batch (their exactness: test_runtime_gpu.py); a Q4_0 file against its dequantized
twin."""
from __future__ import annotations

import pytest
import torch
from quant_models import assert_twin_computes_its_weights

from powerinfer_ray.model.planted import write_planted_gguf
from powerinfer_ray.placement.problem import InfeasibleBudgetError
from powerinfer_ray.runtime.config import GIB, EngineConfig, resolve_plan
from powerinfer_ray.runtime.engine import LocalEngine

pytestmark = pytest.mark.gpu


def _engine_above_the_minimum(tmp_path, preset: str, ec: dict) -> tuple[LocalEngine, float, int]:  # noqa: ANN001
    """The planted preset as a model file (4 layers), its engine under a budget 30 % above the
    solver's minimum for that engine, the budget, and torch's allocation before the engine (its
    peak counter reset there)."""
    spec = str(write_planted_gguf(f"{preset}&layers=4", tmp_path / "m.gguf", progress=False,
                                  stats_dir=tmp_path / "activation", n_tokens=10_000))
    with pytest.raises(InfeasibleBudgetError) as exc:
        resolve_plan(EngineConfig(spec, vram_budget_gib=1e-6, **ec))
    budget = exc.value.min_budget_bytes * 1.3
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return LocalEngine(EngineConfig(spec, vram_budget_gib=budget / GIB, **ec)), budget, base


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_cuda_vram_budget_holds_measured_for_quantized(qtype, tmp_path):
    """A 7B-shape model file (4 layers) quantized, under a budget 30 % above the solver's minimum:
    the peak of torch's allocations while it loads, prefills a 64-token prompt (the CPU shard's
    blocks streamed to the GPU) and decodes 16 steps as graphs is within budget + 2 %. From a file,
    as users run it: a planted model generates its rows on the GPU as it loads (~1.7 GB of
    temporaries at this shape), which is the generator's memory, not the engine's."""
    ec = dict(device="cuda", max_batch=1, n_ctx=128, policy="predictor")
    eng, budget, base = _engine_above_the_minimum(tmp_path, f"llama2-7b?dtype={qtype}", ec)
    try:
        assert sum(len(lp.cpu_neurons) for lp in eng.primary.plan.layers) > 0  # a hybrid split
        prompt = list(range(5, 69))
        eng.primary.step([0], [prompt], [0])
        for i in range(16):
            eng.primary.step([0], [[7 + i]], [len(prompt) + i])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        held = eng.primary.weight_bytes()
    finally:
        eng.close()
    assert held <= budget and peak <= 1.02 * budget, (held, peak, budget)


@pytest.mark.parametrize("placement, sites", [("primary", ()), ("mixed", ("ffn",))])
def test_cuda_primary_multiplies_x_as_it_is(tmp_path, placement, sites):
    """The GPU kernels dequantize Q4_0 rows in registers and multiply x as it is (f32 here): the
    embedded model's Q4_0 file computes its F32 twin's float64 forward with every FFN row on the
    GPU, and with half of them on the CPU executor, x rounded to Q8_0 before those rows alone."""
    assert_twin_computes_its_weights(tmp_path, placement, sites, 1e-4, cpu_rows_only=placement == "mixed",
                                     device="cuda", dtype="f32")


def test_cuda_vram_budget_holds_at_the_largest_batch(tmp_path):
    """A 7B-shape f16 model file (4 layers) under a budget 30 % above the solver's minimum for an engine
    of max_batch 32: torch's peak allocation while it loads, captures the decode graphs of every batch
    size, prefills a 512-token chunk (every CPU row streamed), then 31 prompts in one step (a share
    streamed, the CPU executor the rest) and decodes the 32 sequences together stays within budget +
    2 %, and the weights and KV cache within the budget: the plan reserved the KV cache, the graphs
    and the workspaces of that batch (``runtime.workspace``)."""
    chunk, B = 512, 32
    ec = dict(device="cuda", max_batch=B, n_ctx=chunk + 16, prefill_chunk=chunk, policy="predictor")
    eng, budget, base = _engine_above_the_minimum(tmp_path, "llama2-7b?dtype=f16", ec)
    try:
        p = eng.primary
        assert sum(len(lp.cpu_neurons) for lp in p.plan.layers) > 0  # a hybrid split
        assert set(p.graphs) == {1, 2, 4, 8, 16, 32}
        p.step([0], [list(range(5, 5 + chunk))], [0])
        p.step(list(range(1, B)), [[7, 8, 9, 10]] * (B - 1), [0] * (B - 1))
        pos = [chunk] + [4] * (B - 1)
        for i in range(4):
            p.step(list(range(B)), [[11 + i]] * B, pos)
            pos = [q + 1 for q in pos]
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        held = p.weight_bytes()
        assert p.stats.graph_steps == 4 and p.stats.streamed_bytes > 0 and p.stats.graph_captures == 6
    finally:
        eng.close()
    assert held <= budget and peak <= 1.02 * budget, (held, peak, budget)
