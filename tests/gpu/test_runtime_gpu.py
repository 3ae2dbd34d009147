"""The hybrid runtime with the primary executor on CUDA (fp16 weights), against the fp32 dense
reference: the same plans as the CPU tests, the real channel with pinned host buffers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.plan import Plan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["llama-reglu", "llama-gqa", "opt", "falcon-gqa"])
@pytest.mark.parametrize("split", ["all-gpu", "mixed", "split-heads"])
@pytest.mark.parametrize("policy", ["oracle", "predictor"])
def test_cuda_primary_matches_reference(tmp_path, variant, split, policy):
    path = write_tiny_model(tmp_path / "m.gguf", variant, seed=3, n_layer=3, n_ctx=64, dtype="f16",
                            predictor_rank=16, n_embd=128, n_ff=512)
    ref = ReferenceModel.from_file(path)
    cfg = ref.cfg
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.4 for _ in range(cfg.n_layer)]
    groups = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    plan = {"all-gpu": Plan.all_gpu(cfg), "mixed": Plan.from_masks(masks, None, cfg),
            "split-heads": Plan.from_masks(masks, groups, cfg)}[split]
    eng = LocalEngine(EngineConfig(str(path), plan=plan, policy=policy, device="cuda", prefill_chunk=16))
    try:
        prompt = list(range(3, 19))
        got = [eng.primary.step([0], [prompt], [0])[0]]
        for i, t in enumerate([5, 77, 130]):
            got.append(eng.primary.step([0], [[t]], [len(prompt) + i])[0])
        if policy == "oracle":  # must equal dense: fp16 weights, fp32 accumulation
            full = ref.forward(prompt + [5, 77, 130], ref.new_cache())
            want = [full[len(prompt) - 1]] + [full[len(prompt) + i] for i in range(3)]
            for g, w in zip(got, want):
                err = (torch.from_numpy(g) - w).abs().max() / w.abs().max()
                assert err < 2e-2, float(err)
        else:
            assert eng.primary.stats.neurons > 0
        assert eng.primary.stats.exchanges > 0 or split == "all-gpu"
    finally:
        eng.close()
