"""The executor group's start across Ray actors (runtime/group.py, actors/executors.RayBackend):
a planted model's CPU shard written by the primary into the CPU executor's shared file, or by the
CPU executor itself, gives the same greedy tokens as the dense reference of the same weights.
Members started before their spec is known (``RayBackend.start``: the processes, imports and CUDA
context overlap the coordinator's placement solve) load when the group starts and serve the same
tokens; one the split does not need, or one of a start that failed, does not stay behind."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import ray
from ties import assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.actors.executors import RayBackend
from powerinfer_ray.model.planted import planted_model
from powerinfer_ray.model.source import open_model, rows_faster_on
from powerinfer_ray.runtime.engine import EngineConfig, executor_spec, resolve_plan
from powerinfer_ray.runtime.group import start_group

SPEC = "planted:tiny?layers=2"


def _greedy(primary, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    logits = ray.get(primary.step.remote([0], [prompt], [0]))[0]
    out = [int(np.argmax(logits))]
    for i in range(n - 1):
        logits = ray.get(primary.step.remote([0], [[out[-1]]], [len(prompt) + i]))[0]
        out.append(int(np.argmax(logits)))
    return out


def test_primary_fill_across_actors_gives_the_dense_greedy_tokens(ray_cluster):
    prompt = list(range(5, 25))
    ref = planted_model(SPEC.removeprefix("planted:")).reference()
    ec = EngineConfig(SPEC, gpu_fraction=0.5, policy="oracle", max_batch=2, threads=1)
    src = open_model(SPEC)
    assert not rows_faster_on(src, "cpu")  # on a CUDA primary the engine has the primary fill
    plan = resolve_plan(ec, src)
    for fills in (True, False):  # the primary writes the rows (forced on a CPU primary) / the CPU executor
        gs = replace(executor_spec(ec, src, plan, "cpu", threads=1), primary_fills=fills)
        group = start_group(RayBackend(f"test-fill-{fills}"), gs)
        try:
            assert ("fill_cold" in group.load_s) == fills, group.load_s
            assert_greedy(ref, prompt, _greedy(group.primary, prompt, 8))
        finally:
            group.close()


def _named(name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def _released(names: list[str], within_s: float = 60.0) -> list[str]:
    """The names still held after waiting up to within_s for them to be released."""
    deadline = time.time() + within_s
    held = [n for n in names if _named(n)]
    while held and time.time() < deadline:
        time.sleep(0.2)
        held = [n for n in names if _named(n)]
    return held


@pytest.mark.parametrize("gpu_fraction", [0.5, 1.0])
def test_members_started_early_load_when_the_group_starts(ray_cluster, gpu_fraction):
    prompt = list(range(5, 25))
    ref = planted_model(SPEC.removeprefix("planted:")).reference()
    src = open_model(SPEC)
    ec = EngineConfig(SPEC, gpu_fraction=gpu_fraction, policy="oracle", max_batch=2, threads=1)
    spec = executor_spec(ec, src, resolve_plan(ec, src), "cpu", threads=1)
    name = f"test-start-{gpu_fraction}"
    backend = RayBackend(name)
    early = {role: backend.start(role, "cpu", 1) for role in ("primary", "cpu")}
    group = start_group(backend, spec)
    try:
        assert group.primary is early["primary"]
        if spec.plan.needs_cpu_executor:
            assert group.cpu is early["cpu"]
        else:  # all on the primary: the CPU executor started early is gone, its CPU free again
            assert group.cpu is None and not _released([f"{name}.cpu-executor.0"])
        assert_greedy(ref, prompt, _greedy(group.primary, prompt, 6))
    finally:
        group.close()
    assert not _released([f"{name}.gpu-executor.cpu", f"{name}.cpu-executor.0"])


def test_a_start_that_fails_leaves_no_member_behind(ray_cluster):
    """The placement fails (a budget below the minimum) after the members started: the engine's
    error says so, and their names (and CPUs) are released."""
    name = "test-start-budget"
    eng = Coordinator.options(name=name).remote(SPEC, vram_budget_gib=1e-6, threads=1)
    with pytest.raises(ray.exceptions.RayActorError, match="too small"):
        ray.get(eng.ready.remote(), timeout=120)
    assert not _released([f"{name}.gpu-executor.cpu", f"{name}.cpu-executor.0"])
