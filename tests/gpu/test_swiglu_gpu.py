"""The SwiGLU modes with the primary executor on CUDA (fp16 weights): the trained tiny SwiGLU
model sparsified at 0.5, against its fp32 thresholded reference; decode graphs against eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from swiglu_models import sparsified as sparsified_model

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.plan import Plan

pytestmark = pytest.mark.gpu
PROMPT, DECODE = [5, 60, 7, 200, 41, 12, 99, 150, 3, 42, 17, 250, 8, 77, 120, 31], [7, 99, 150]


@pytest.fixture(scope="module")
def sparsified(tmp_path_factory):
    path = sparsified_model(tmp_path_factory.mktemp("m") / "tiny-swiglu-0.5.gguf")
    return path, ReferenceModel.from_file(path)


def _plan(cfg, split):
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)]
    return Plan.all_gpu(cfg) if split == "all-gpu" else Plan.from_masks(masks, None, cfg)


@pytest.mark.parametrize("split", ["all-gpu", "mixed"])
@pytest.mark.parametrize("policy", ["gate-first", "oracle"])
@pytest.mark.parametrize("graphs", [False, True])
def test_exact_modes_on_cuda_match_the_thresholded_reference(sparsified, split, policy, graphs):
    """Prefill (the eager gate-first: one gate GEMV, the kernel with gate_pre) and decode steps
    (graphs: the packed split of the gate values) give the thresholded model's logits (fp16 weights:
    a gate value at the threshold may round either way, so the tolerance is a few per cent) and
    about half of the neurons computed."""
    path, ref = sparsified
    if policy == "oracle" and graphs:
        pytest.skip("policy 'oracle' runs eager steps")
    eng = LocalEngine(EngineConfig(str(path), plan=_plan(ref.cfg, split), policy=policy, device="cuda",
                                   prefill_chunk=16, graphs=graphs))
    try:
        got = [eng.primary.step([0], [PROMPT], [0])[0]]
        for i, t in enumerate(DECODE):
            got.append(eng.primary.step([0], [[t]], [len(PROMPT) + i])[0])
        computed = eng.primary.stats.neurons + (eng.cpu.stats.neurons if eng.cpu is not None else 0)
        if graphs:
            assert 1 in eng.primary.graphs
    finally:
        eng.close()
    full = ref.forward(PROMPT + DECODE, ref.new_cache())
    want = [full[len(PROMPT) - 1]] + [full[len(PROMPT) + i] for i in range(len(DECODE))]
    for g, w in zip(got, want):
        err = (torch.from_numpy(g) - w).abs().max() / w.abs().max()
        assert err < 5e-2, float(err)
    n_all = (len(PROMPT) + len(DECODE)) * ref.cfg.n_ff * ref.cfg.n_layer
    assert 0.4 < computed / n_all < 0.6


def test_gate_first_graph_decode_equals_the_eager_step(sparsified):
    """Batched decode (three sequences padded to four) as CUDA graphs: the eager step's logits and
    neuron counts on both executors (padding rows activate nothing)."""
    path, ref = sparsified
    plan = _plan(ref.cfg, "mixed")
    runs = {}
    for graphs in (False, True):
        eng = LocalEngine(EngineConfig(str(path), plan=plan, policy="gate-first", device="cuda", prefill_chunk=16,
                                       max_batch=4, graphs=graphs))
        try:
            prompts = [[5, 6, 7], list(range(10, 22)), [200, 1, 2, 3]]
            for slot, p in enumerate(prompts):
                eng.primary.step([slot], [p], [0])
            n0 = (eng.primary.stats.neurons, eng.cpu.stats.neurons)
            out = eng.primary.step([0, 1, 2], [[11], [12], [13]], [len(p) for p in prompts])
            runs[graphs] = (out, eng.primary.stats.neurons - n0[0], eng.cpu.stats.neurons - n0[1])
        finally:
            eng.close()
    a, b = runs[False], runs[True]
    err = float(np.abs(a[0] - b[0]).max() / np.abs(a[0]).max())
    assert err < 1e-3 and a[1:] == b[1:] and b[1] > 0 and b[2] > 0, (err, a[1:], b[1:])
