"""Engine replicas: N whole engines, each on one node in a placement group of its own.

A replica is one engine, the ``Coordinator`` actor and its executors, in a placement group of one
bundle. The bundle is what the replica takes of one node: the GPU executor's CPU and GPU share,
the CPU executor's threads, and one unit of a custom resource when one is named. A bundle never
spans nodes, so the replica's members land together (the per-layer channel is node-local) and a
GPU bundle pins the replica to one GPU: on a host with several GPUs, one replica per GPU. The
coordinator takes no resources of its own in the bundle and starts its executors into it
(``executors.RayBackend``).

Ray keeps the count. When a replica's node dies, Ray reschedules its placement group; when a node
with room appears (the same one back, or a new one) Ray places the group there and restarts the
coordinator (``max_restarts=-1``), which starts its executors anew. A replica whose bundle fits
nowhere yet waits the same way: adding a node with room starts it. Replicas are plain named
actors (``powerinfer-engine-0``, ``-1``, ...) called as a single engine is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..runtime.config import EngineConfig, check_int, check_number, resolve_plan
from .coordinator import DEFAULT_NAME, Coordinator

log = logging.getLogger(__name__)
PLACEMENT_SUFFIX = ".placement"  # a replica's placement group is named after its engine


@dataclass(frozen=True)
class Replica:
    """One engine replica as its caller holds it: the engine's name, its actor, its placement group
    (None for the single engine, which runs without one)."""

    name: str
    engine: ActorHandle
    placement: PlacementGroup | None = None


def replica_names(base: str, n: int) -> list[str]:
    """The engines' actor names: the single engine keeps ``base``; replicas are ``base-0`` ... ``base-(n-1)``."""
    check_int("replicas", n, 1)
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def replica_bundle(device: str, threads: int, cpu_executor: bool, gpus: float = 1.0,
                   resource: str | None = None) -> dict[str, float]:
    """The placement-group bundle of one replica: one CPU for the primary executor (and ``gpus`` of a
    GPU when it drives one), ``threads`` CPUs for the CPU executor when the plan has one, one unit
    of ``resource`` when named."""
    check_number("replica_gpus", gpus, 0.0, 1.0, lo_open=True)
    check_int("threads", threads, 1)
    bundle = {"CPU": 1.0 + (threads if cpu_executor else 0)}
    if device == "cuda":
        bundle["GPU"] = float(gpus)
    if resource:
        bundle[resource] = 1.0
    return bundle


def node_capacity(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles' non-CPU resources a node holds (a large number when the bundle has none)."""
    counts = [int(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if k != "CPU" and v > 0]
    return min(counts) if counts else 1 << 20


def default_threads(nodes: list[dict[str, float]], bundle: dict[str, float], replicas: int) -> int:
    """The CPU executor threads of each replica when none are given: on the smallest node that can
    host a replica, its CPUs shared among the replicas it hosts (as many as its GPUs or custom
    resource allow, at most ``replicas``), one CPU each for the GPU executor, one left over, as a
    single engine leaves one. nodes: the resources of the cluster's alive nodes."""
    best = None
    for node in nodes:
        k = min(node_capacity(node, bundle), replicas)
        if k < 1 or node.get("CPU", 0) < 1:
            continue
        t = (int(node["CPU"]) - 1) // k - 1
        best = t if best is None else min(best, t)
    if best is None:
        need = {k: v for k, v in bundle.items() if k != "CPU"}
        raise ValueError(f"replicas: no node of the Ray cluster has the resources of a replica ({need}); start "
                         "nodes with them (ray start --num-gpus / --resources) or change replica_gpus / "
                         "replica_resource")
    return max(1, best)


def check_fits(nodes: list[dict[str, float]], bundle: dict[str, float]) -> None:
    """Some node of the cluster can hold a replica's bundle (busy now or not): else no replica could
    ever start, and the caller would wait forever."""
    if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
        have = [{k: v for k, v in n.items() if k in bundle} for n in nodes]
        raise ValueError(f"replicas: a replica needs {bundle} of one node, and no node of the Ray cluster has it "
                         f"(nodes: {have}); lower threads or replica_gpus, or start a node with those resources")


def cluster_device() -> str:
    """The replicas' device when none is given: cuda when the cluster has a GPU (on any node: the
    driver's own host may have none)."""
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def _alive_nodes() -> list[dict[str, float]]:
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def replica_config(ec: EngineConfig, replicas: int, gpus: float = 1.0,
                   resource: str | None = None) -> tuple[EngineConfig, dict[str, float]]:
    """The replicas' engine config, with the device, the threads and the plan resolved once for all
    of them (each replica gets the same budget), and their bundle."""
    device = ec.device or cluster_device()
    plan = ec.plan or resolve_plan(ec)
    threads = ec.threads
    if threads is None and plan.needs_cpu_executor:
        threads = default_threads(_alive_nodes(), replica_bundle(device, 1, False, gpus, resource), replicas)
    bundle = replica_bundle(device, threads or 1, plan.needs_cpu_executor, gpus, resource)
    check_fits(_alive_nodes(), bundle)
    if device == "cuda" and gpus < 1 and plan.needs_cpu_executor:
        log.warning("replica_gpus=%g: replicas share a GPU and contend for it (on an H200, two 13B replicas with "
                    "8 GiB each served 0.70x each of one such engine alone, and 0.13x together one engine with "
                    "the 16 GiB: bench/RESULTS.md, scale-out); one replica per GPU (replica_gpus=1) serves "
                    "without that contention", gpus)
    return replace(ec, device=device, threads=threads, plan=plan), bundle


def start_replicas(ec: EngineConfig, replicas: int, gpus: float = 1.0, resource: str | None = None,
                   name: str = DEFAULT_NAME, namespace: str | None = None) -> list[Replica]:
    """Create ``replicas`` engines, each in a placement group of its own (found by name when it
    exists already: a restarted caller takes its replicas back). Returns at once: a replica starts
    when Ray has placed its group; ``Router`` and ``wait_replicas`` follow them."""
    ec, bundle = replica_config(ec, replicas, gpus, resource)
    options = {f.name: getattr(ec, f.name) for f in fields(ec) if f.name != "model"}
    out = []
    for engine_name in replica_names(name, replicas):
        pg = _placement(engine_name + PLACEMENT_SUFFIX, bundle)
        engine = Coordinator.options(
            name=engine_name, namespace=namespace, get_if_exists=True, max_concurrency=1000, num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(ec.model, name=engine_name, **options)
        out.append(Replica(engine_name, engine, pg))
    log.info("started %d replicas of %s, each in a bundle %s", replicas, ec.model, bundle)
    return out


def _placement(name: str, bundle: dict[str, float]) -> PlacementGroup:
    """The placement group of that name (in the caller's namespace), created when there is none."""
    try:
        return ray.util.get_placement_group(name)
    except ValueError:  # none by that name
        return placement_group([bundle], strategy="PACK", name=name)


def stop_replicas(replicas: list[Replica], timeout_s: float = 30.0) -> None:
    """Stop each engine (its executors and their channel first; an engine still waiting for its
    node is not waited for), kill it so that Ray does not restart it, and remove its placement group."""
    placed = [r for r in replicas if r.placement is None or _state(r.placement) == "CREATED"]
    try:
        ray.wait([r.engine.shutdown.remote() for r in placed], num_returns=len(placed), timeout=timeout_s)
    finally:
        for r in replicas:
            try:
                ray.kill(r.engine, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass
            if r.placement is not None:
                remove_placement_group(r.placement)


def _state(pg: PlacementGroup) -> str:
    """A placement group's state: PENDING, CREATED, RESCHEDULING (its node died) or REMOVED."""
    return placement_group_table(pg).get("state", "REMOVED")
