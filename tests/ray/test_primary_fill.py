"""A planted model's CPU shard written by the primary (runtime/sharedshard.py fill), across the
engine's actor processes: the same greedy tokens as the dense reference of the same weights."""
from __future__ import annotations

import ray

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.planted import planted_model


def test_primary_fill_across_actors_gives_the_dense_greedy_tokens(ray_cluster):
    spec = "planted:tiny?layers=2"
    ref = planted_model(spec.removeprefix("planted:")).reference()
    prompt = list(range(5, 25))
    want = ref.generate_greedy(prompt, 8)
    for fill in ("1", "0"):  # the primary fills (forced on a CPU primary) / the CPU executor loads
        eng = Coordinator.options(runtime_env={"env_vars": {"POWERINFER_RAY_PRIMARY_FILL": fill}}).remote(
            spec, gpu_fraction=0.5, policy="oracle", max_batch=2, threads=1)
        try:
            info = ray.get(eng.ready.remote())
            assert ("fill_cold" in info["load_s"]) == (fill == "1"), info
            out = ray.get(eng.generate.remote(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True))
            assert out["token_ids"] == want, fill
        finally:
            ray.get(eng.shutdown.remote())
            ray.kill(eng)
