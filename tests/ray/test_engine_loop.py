"""The CPU executor's compiled serving loop (kernels.cpu_ffn.ServeLoop) in an engine on a real local
Ray cluster: the executors in their own processes, as users run them."""
from __future__ import annotations

import ray
from ties import assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model


def test_the_cpu_executors_compiled_loop_answers_the_ffn_exchanges(ray_cluster, tmp_path):
    """Every head on the primary (policy 'dense': exact, every CPU row): each exchange is an FFN
    request, which the CPU executor's compiled serving loop answers, all but the first after an
    idle spell, also after its threads change live; the tokens are the dense reference's, and both
    executors count every exchange once."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama-gqa", seed=5, n_layer=3, n_ctx=256, predictor_rank=16)
    ref = ReferenceModel.from_file(path)
    eng = Coordinator.options(name="test-engine-loop", num_cpus=0).remote(str(path), gpu_fraction=0.5,
                                                                          policy="dense", max_batch=2, threads=1)
    try:
        served = 0
        for i, threads in enumerate((1, 2)):
            assert ray.get(eng.set_cpu_threads.remote(threads)) == threads
            prompt = list(range(5 + i, 15 + i))
            out = ray.get(eng.generate.remote(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True))
            assert_greedy(ref, prompt, out["token_ids"])
            st = ray.get(eng.stats.remote())
            cpu = st["cpu_executor"]
            assert cpu["exchanges"] == st["gpu_executor"]["exchanges"] > cpu["compiled_exchanges"] > served
            assert cpu["threads"] == threads and cpu["busy_s"] > cpu["kernel_s"] > 0 and cpu["neurons"] > 0
            served = cpu["compiled_exchanges"]
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
