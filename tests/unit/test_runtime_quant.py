"""Q8_0 / Q4_0 models through the hybrid runtime without Ray (the CPU executor serves in a thread):
on every split the logits equal the dense forward over the dequantized weights with the CPU
kernels' Q8_0 activation rounding (quant_models.KernelReference), to 1e-5, once the reference
takes the runtime's side of the rounding ties its fp32 arithmetic may decide either way
(quant_models.match_rounding)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_models import KernelReference, match_rounding, write_upstream_int4

from powerinfer_ray.model.tiny import tiny_config, write_tiny_model
from powerinfer_ray.runtime.config import EngineConfig
from powerinfer_ray.runtime.engine import LocalEngine
from powerinfer_ray.runtime.plan import Plan

VARIANTS = ["llama-gqa", "qwen2", "opt", "falcon-gqa"]
SPLITS = ["all-gpu", "all-cpu", "mixed", "split-heads"]
TOL = 1e-5  # float64 against the runtime's fp32, rounding ties matched


def _plan(cfg, split: str) -> Plan:
    rng = np.random.default_rng(0)
    masks = [rng.random(cfg.n_ff) < 0.3 for _ in range(cfg.n_layer)]
    half = [np.arange(cfg.n_head_kv) < max(1, cfg.n_head_kv // 2)] * cfg.n_layer
    return {"all-gpu": Plan.all_gpu(cfg), "all-cpu": Plan.all_cpu(cfg), "mixed": Plan.from_masks(masks, None, cfg),
            "split-heads": Plan.from_masks(masks, half, cfg)}[split]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models with head_dim 32 (a head's rows and columns are whole blocks) in both types."""
    d = tmp_path_factory.mktemp("qmodels")
    return {(v, q): write_tiny_model(d / f"{v}.{q}.gguf", v, seed=1, n_layer=3, n_ctx=64, n_embd=128, dtype=q)
            for v in VARIANTS for q in ("q8_0", "q4_0")}


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", SPLITS)
def test_oracle_masks_equal_the_kernels_reference(models, variant, qtype, split):
    """Prefill in chunks, then cached decode steps: every step's logits."""
    path = models[variant, qtype]
    ref = KernelReference.from_file(path)
    assert ref.cfg.dtype == qtype and ref.quantized
    eng = LocalEngine(EngineConfig(str(path), plan=_plan(ref.cfg, split), policy="oracle", prefill_chunk=8,
                                   max_batch=2))
    try:
        prompt, decode = list(range(3, 20)), [7, 99, 150, 3, 42]
        got, pos = [], 0
        for i in range(0, len(prompt), 8):
            got.append(eng.primary.step([0], [prompt[i:i + 8]], [pos])[0])
            pos += len(prompt[i:i + 8])
        for t in decode:
            got.append(eng.primary.step([0], [[t]], [pos])[0])
            pos += 1
        lw = eng.primary.weights.layers[0]
        assert lw.attn.qtype == qtype and (lw.ffn.qtype == qtype or lw.ffn.n == 0)
        if split != "all-gpu":
            assert eng.cpu.ffn[0].qtype == qtype and eng.cpu.stats.exchanges > 0
    finally:
        eng.close()
    at = [min(i + 8, len(prompt)) - 1 for i in range(0, len(prompt), 8)] + [len(prompt) + j for j in range(len(decode))]
    errs, flips = match_rounding(ref, prompt + decode, got, at)
    assert max(errs) < TOL, (errs, flips)
