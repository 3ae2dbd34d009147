"""A quantized model on a real local Ray cluster (num_cpus=2): upstream's INT4 layout, written by
gguf-py, served by the engine actor with both executors."""
from __future__ import annotations

import numpy as np
import ray
from quant_models import KernelReference, write_upstream_int4
from ties import assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.tiny import tiny_config


def test_upstream_int4_file_generates_on_ray(ray_cluster, tmp_path):
    """Half the neurons and a KV-head group on the CPU executor actor, which computes on the
    file's Q4_0 blocks in place; the 12-token prompt runs the CPU shard's blocks on the primary,
    streamed from the same file's map, the decode steps exchange with it: the greedy tokens of
    the dense forward over the dequantized weights with the CPU kernels' Q8_0 rounding."""
    cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=64, tied_output=False, norm_eps=1e-6,
                      dtype="q4_0")
    path = tmp_path / "tiny.q4.powerinfer.gguf"
    write_upstream_int4(path, cfg, np.random.default_rng(11))
    ref = KernelReference.from_file(path)
    eng = Coordinator.options(name="test-engine-q4").remote(str(path), gpu_fraction=0.5, cpu_groups=1, policy="oracle",
                                                            max_batch=2, threads=1, prefill_dense_min=8)
    try:
        info = ray.get(eng.ready.remote())
        assert info["dense_prefill"] == "file" and info["executors_ready"][1]["ffn_rows"] == "file"
        prompts = [[1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100], [1, 84, 104, 101]]
        outs = ray.get([eng.generate.remote(prompt_token_ids=p, max_tokens=8, ignore_eos=True) for p in prompts])
        for p, o in zip(prompts, outs):
            assert len(o["token_ids"]) == 8
            assert_greedy(ref, p, o["token_ids"])
        st = ray.get(eng.stats.remote())
        assert st["cpu_executor"]["neurons"] > 0 and st["gpu_executor"]["cold_neurons"] > 0
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
