"""The executor group's fill step across Ray actors (runtime/group.py): a planted model's CPU
shard written by the primary into the CPU executor's shared file, or by the CPU executor itself,
gives the same greedy tokens as the dense reference of the same weights."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import ray

from powerinfer_ray.actors.executors import RayBackend
from powerinfer_ray.model.planted import planted_model
from powerinfer_ray.model.source import open_model, rows_faster_on
from powerinfer_ray.runtime.engine import EngineConfig, executor_spec, resolve_plan
from powerinfer_ray.runtime.group import start_group


def _greedy(primary, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    logits = ray.get(primary.step.remote([0], [prompt], [0]))[0]
    out = [int(np.argmax(logits))]
    for i in range(n - 1):
        logits = ray.get(primary.step.remote([0], [[out[-1]]], [len(prompt) + i]))[0]
        out.append(int(np.argmax(logits)))
    return out


def test_primary_fill_across_actors_gives_the_dense_greedy_tokens(ray_cluster):
    spec = "planted:tiny?layers=2"
    prompt = list(range(5, 25))
    want = planted_model(spec.removeprefix("planted:")).reference().generate_greedy(prompt, 8)
    ec = EngineConfig(spec, gpu_fraction=0.5, policy="oracle", max_batch=2, threads=1)
    src = open_model(spec)
    assert not rows_faster_on(src, "cpu")  # on a CUDA primary the engine has the primary fill
    plan = resolve_plan(ec, src)
    for fills in (True, False):  # the primary writes the rows (forced on a CPU primary) / the CPU executor
        gs = replace(executor_spec(ec, src, plan, "cpu", threads=1), primary_fills=fills)
        group = start_group(RayBackend(f"test-fill-{fills}"), gs)
        try:
            assert ("fill_cold" in group.load_s) == fills, group.load_s
            assert _greedy(group.primary, prompt, 8) == want, fills
        finally:
            group.close()
