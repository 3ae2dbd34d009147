"""An executor group: the primary executor, a CPU executor when the plan gives the CPU work, and
the shared-memory channel between them, started by one script (``start_group``) on a backend:
in this process (``LocalBackend``: the CPU executor serves in a thread of its own) or as Ray
actors (``actors.executors.RayBackend``). The members of both backends answer the same calls.

The script:
  0. check that the executors fit the host's memory (``hostmem.check_fits``), before loading;
  1. create the executors (on Ray they load their shards in parallel) and wait until ready;
  2. fill: when the weight source makes rows faster on the primary's device
     (``model.source.rows_faster_on``: a planted model on a GPU), the CPU executor has only laid
     its shared file out; the primary writes the rows in, the CPU executor touches them (or
     writes them itself if the primary could not);
  3. the primary creates the channel, the CPU executor maps it and serves it;
  4. the primary maps the CPU executor's rows for dense prefill of long prompts;
  5. the primary captures its decode graphs of every batch size the engine admits;
  6. the step: a call in a worker thread, or a Unix socket to the primary's actor.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from .channel import ChannelSpec
from ..model.source import WeightSource, open_model
from .cpu_executor import CPUExecutor
from .hostmem import check_fits, host_need
from .plan import Plan
from .sampling import Burst
from .primary import PrimaryExecutor
from .sharedshard import SharedShardSpec

log = logging.getLogger(__name__)
StepFn = Callable[[list[int], list[list[int]], list[int]], Awaitable[np.ndarray]]


@dataclass(frozen=True)
class GroupSpec:
    """What the executors of one engine are built from (``engine.executor_spec`` makes it)."""

    model: Any  # a path or planted spec (each executor opens it), or a WeightSource (in process)
    plan: Plan
    device: str  # the primary's
    policy: str
    slots: int  # sequences of the KV caches
    n_ctx: int
    t_max: int  # tokens per step
    threads: int | None = None  # CPU executor threads (None: torch's default)
    threshold: float | None = None
    margin: float = 0.0  # the predictor threshold is lowered by this
    dtype: str | None = None
    timeout_s: float = 60.0
    prefill_dense_min: int | None = None
    graphs: bool | None = None
    zero_copy: float | None = None
    prefill_share: float | None = None
    primary_fills: bool = False  # the primary writes the CPU executor's rows (step 2)
    host_memory_bytes: int | None = None  # host memory the executors may take (None: what the host has available)

    def primary_kwargs(self) -> dict[str, Any]:
        return dict(device=self.device, policy=self.policy, threshold=self.threshold, margin=self.margin, slots=self.slots,
                    n_ctx=self.n_ctx, t_max=self.t_max, dtype=self.dtype, timeout_s=self.timeout_s,
                    prefill_dense_min=self.prefill_dense_min, graphs=self.graphs, zero_copy=self.zero_copy,
                    prefill_share=self.prefill_share)

    def cpu_kwargs(self) -> dict[str, Any]:
        return dict(policy=self.policy, slots=self.slots, n_ctx=self.n_ctx, threads=self.threads,
                    defer_fill=self.primary_fills)


class Backend(Protocol):
    """Where a group's members live and how they are called."""

    task_error: type[BaseException]  # what a call that failed inside a member raises

    def create(self, role: str, spec: GroupSpec) -> Any: ...  # role: "primary" | "cpu"  # noqa: ANN401

    def call(self, calls: list[tuple[Any, str, tuple]]) -> list[Any]: ...  # (member, method, args), all at once

    def step_fn(self, primary: Any) -> StepFn: ...  # noqa: ANN401

    def close(self, group: "ExecutorGroup") -> None: ...


@dataclass
class ExecutorGroup:
    """A started group: its members, the channel and shard specs, and the step function."""

    backend: Backend
    primary: Any = None
    cpu: Any = None
    channel: ChannelSpec | None = None
    shard: SharedShardSpec | None = None
    dense_prefill: str | None = None  # where dense prefill reads the CPU shard: shared | copy | None
    load_s: dict[str, float] = field(default_factory=dict)  # seconds of each start step
    ready: list[dict] = field(default_factory=list)  # the members' ready() answers (load phases, memory)
    step: StepFn | None = None

    def close(self) -> None:
        """Stop and release the members (on Ray: kill them)."""
        self.backend.close(self)


def start_group(backend: Backend, spec: GroupSpec, src: WeightSource | None = None) -> ExecutorGroup:
    """Run the start script (see the module docstring); all or nothing: a failure closes what
    was started (a half-built group would hold the actor names a retry needs). src: the model
    as this process already opened it (default: opened from spec.model)."""
    g = ExecutorGroup(backend)

    def call(member: Any, method: str, *args: Any) -> Any:  # noqa: ANN401
        return backend.call([(member, method, args)])[0]

    t0 = time.perf_counter()
    src = src or open_model(spec.model)
    check_fits(host_need(src, spec.plan, spec.slots, spec.n_ctx), spec.host_memory_bytes,
               f"the model {src.config.name or spec.model}")
    g.load_s["check"] = round(time.perf_counter() - t0, 2)
    try:
        t_m = time.perf_counter()
        g.primary = backend.create("primary", spec)
        g.cpu = backend.create("cpu", spec) if spec.plan.needs_cpu_executor else None
        info = backend.call([(m, "ready", ()) for m in (g.primary, g.cpu) if m is not None])
        g.load_s["members"] = round(time.perf_counter() - t_m, 2)  # processes started, shards loaded
        log.info("executors ready: %s", [{k: v for k, v in i.items() if k != "shard_spec"} for i in info])
        # seconds each executor took to build its shard (in parallel on Ray), then the steps below
        g.load_s.update(zip(("gpu", "cpu"), (round(i["load_s"], 2) for i in info)))
        g.ready = info
        if g.cpu is not None:
            g.shard = info[1]["shard_spec"]
            if info[1]["needs_fill"]:
                _fill(g, backend)
        g.channel = call(g.primary, "create_channel")
        if g.cpu is not None:
            call(g.cpu, "attach", g.channel)
            t_a = time.perf_counter()
            g.dense_prefill = call(g.primary, "attach_cold", g.shard)
            g.load_s["attach_cold"] = round(time.perf_counter() - t_a, 2)
        t_g = time.perf_counter()
        call(g.primary, "capture_graphs")
        g.load_s["graphs"] = round(time.perf_counter() - t_g, 2)
        g.step = backend.step_fn(g.primary)
        g.load_s["total"] = round(time.perf_counter() - t0, 2)
    except BaseException:
        g.close()
        raise
    return g


def _fill(g: ExecutorGroup, backend: Backend) -> None:
    """The primary writes the CPU executor's rows; if it cannot, the CPU executor does."""
    t_f = time.perf_counter()
    try:
        backend.call([(g.primary, "fill_cold", (g.shard,))])
        by_primary = True
    except backend.task_error as e:  # e.g. it cannot open the file
        log.warning("the primary could not write the CPU executor's rows (%s); it writes them itself", e)
        by_primary = False
    backend.call([(g.cpu, "filled", (by_primary,))])
    g.load_s["fill_cold" if by_primary else "cpu_fill"] = round(time.perf_counter() - t_f, 2)


class LocalBackend:
    """The members as objects of this process; steps run in a worker thread, each holding
    ``step_lock`` (what reads the members between two steps takes too)."""

    task_error = Exception

    def __init__(self) -> None:
        self.step_lock = threading.Lock()

    def create(self, role: str, spec: GroupSpec) -> Any:  # noqa: ANN401
        if role == "primary":
            return PrimaryExecutor(spec.model, spec.plan, **spec.primary_kwargs())
        return CPUExecutor(spec.model, spec.plan, **spec.cpu_kwargs())

    def call(self, calls: list[tuple[Any, str, tuple]]) -> list[Any]:
        return [getattr(member, method)(*args) for member, method, args in calls]

    def step_fn(self, primary: PrimaryExecutor) -> StepFn:
        def locked(slots: list[int], tokens: list[list[int]], start_pos: list[int],
                   burst: Burst | None) -> Any:  # noqa: ANN401
            with self.step_lock:
                return primary.serve_step(slots, tokens, start_pos, burst)

        async def step(slots: list[int], tokens: list[list[int]], start_pos: list[int],
                       burst: Burst | None = None) -> Any:  # noqa: ANN401
            return await asyncio.to_thread(locked, slots, tokens, start_pos, burst)
        return step

    def close(self, group: ExecutorGroup) -> None:
        if group.cpu is not None:
            if group.channel is not None:
                group.primary.stop_peer()
            group.cpu.stop()
        if group.primary is not None:
            group.primary.close()
        group.primary = group.cpu = None
