"""Q8_0 / Q4_0 models with the primary executor on CUDA. Its kernels dequantize the blocks in
registers and multiply x as it is, so the reference is the dense forward over the dequantized
weights (fp32); the float parts and activations are fp16 (tolerance as the fp16 GPU tests: 2e-2),
and a split's CPU share multiplies its Q8_0-rounded activations as ggml does (on these models
that rounding alone moves the logits by up to ~1.5e-2: 4e-2 with a CPU share)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.placement.problem import InfeasibleBudgetError
from powerinfer_ray.runtime.config import GIB, EngineConfig, resolve_plan
from powerinfer_ray.runtime.engine import LocalEngine
from powerinfer_ray.runtime.plan import Plan

pytestmark = pytest.mark.gpu


def _model_and_plan(tmp_path, variant: str, split: str, qtype: str):
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=3, n_layer=3, n_ctx=64, dtype=qtype,
                            predictor_rank=32, n_embd=128, n_ff=512)
    ref = ReferenceModel.from_file(path)
    cfg = ref.cfg
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)]
    groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    plan = {"all-gpu": Plan.all_gpu(cfg), "mixed": Plan.from_masks(masks, None, cfg),
            "split-heads": Plan.from_masks(masks, groups, cfg)}[split]
    return path, ref, plan, 2e-2 if split == "all-gpu" else 4e-2


def _rel(got: np.ndarray, want: torch.Tensor) -> float:
    return float((torch.from_numpy(got) - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", ["llama-gqa", "opt", "falcon-gqa"])
@pytest.mark.parametrize("split", ["all-gpu", "mixed", "split-heads"])
def test_cuda_quantized_oracle_matches_reference(tmp_path, qtype, variant, split):
    """Policy oracle (eager steps): a 16-token prefill and three decode steps."""
    path, ref, plan, tol = _model_and_plan(tmp_path, variant, split, qtype)
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="oracle", device="cuda", prefill_chunk=16))
    try:
        assert eng.primary.weights.layers[0].attn.qtype == qtype
        prompt = list(range(3, 19))
        got = [eng.primary.step([0], [prompt], [0])[0]]
        for i, t in enumerate([5, 77, 130]):
            got.append(eng.primary.step([0], [[t]], [len(prompt) + i])[0])
    finally:
        eng.close()
    full = ref.forward(prompt + [5, 77, 130], ref.new_cache())
    for g, w in zip(got, [full[len(prompt) - 1]] + [full[len(prompt) + i] for i in range(3)]):
        assert _rel(g, w) < tol


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", ["llama-gqa", "opt", "falcon-gqa"])
@pytest.mark.parametrize("split", ["all-gpu", "mixed", "split-heads"])
def test_cuda_quantized_graph_decode_equals_eager_and_reference(tmp_path, qtype, variant, split):
    """Decode steps replayed as CUDA graphs (quantized GEMVs, sparse FFN and predictor inside),
    B = 3 at different positions and B = 1: policy 'dense' equals the dense reference; policy
    'predictor' (Q8_0 / Q4_0 fc1 / fc2) equals the eager step up to a logit at the threshold."""
    path, ref, plan, tol = _model_and_plan(tmp_path, variant, split, qtype)
    prompts = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]]
    toks = [[11, 12, 13], [40, 41, 42], [7, 8, 9]]

    def run(policy, graphs):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy=policy, device="cuda", prefill_chunk=16,
                                       max_batch=4, graphs=graphs, threshold=0.2))
        try:
            for slot, p in enumerate(prompts):
                eng.primary.step([slot], [p], [0])
            pos, out = [len(p) for p in prompts], []
            for step in toks:
                out.append(eng.primary.step([0, 1, 2], [[t] for t in step], pos))
                pos = [q + 1 for q in pos]
            out.append(eng.primary.step([1], [[77]], [pos[1]]))
            assert eng.primary.stats.graph_captures == (2 if graphs else 0)
            if policy == "predictor":
                assert eng.primary.weights.layers[0].fc_qtypes == (qtype, qtype)
            return out, eng.primary.stats.neurons, eng.cpu.stats.neurons if eng.cpu else 0
        finally:
            eng.close()

    dense, _, _ = run("dense", True)
    for slot, p in enumerate(prompts):
        full = ref.forward(p + [t[slot] for t in toks] + ([77] if slot == 1 else []), ref.new_cache())
        for j in range(3):
            assert _rel(dense[j][slot], full[len(p) + j]) < tol
        if slot == 1:
            assert _rel(dense[3][0], full[-1]) < tol
    eager, graph = run("predictor", False), run("predictor", True)
    top_eager = np.concatenate([a.argmax(-1) for a in eager[0]])
    top_graph = np.concatenate([b.argmax(-1) for b in graph[0]])
    assert (top_eager == top_graph).mean() >= 0.9, (top_eager, top_graph)
    assert graph[1] > 0 and abs(graph[1] - eager[1]) <= 0.03 * eager[1]
    assert abs(graph[2] - eager[2]) <= 0.03 * max(eager[2], 1)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_cuda_vram_budget_holds_measured_for_quantized(qtype):
    """A planted 7B-shape model (4 layers) quantized, under a budget 30 % above the solver's
    minimum: the peak of torch's allocations while it loads, prefills a 64-token prompt (the CPU
    shard's blocks streamed to the GPU) and decodes 16 steps as graphs is within budget + 2 %."""
    spec = f"planted:llama2-7b?dtype={qtype}&layers=4"
    ec = dict(device="cuda", max_batch=1, n_ctx=128, policy="predictor")
    with pytest.raises(InfeasibleBudgetError) as exc:
        resolve_plan(EngineConfig(spec, vram_budget_gib=1e-6, **ec))
    budget = exc.value.min_budget_bytes * 1.3
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = LocalEngine(EngineConfig(spec, vram_budget_gib=budget / GIB, **ec))
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
