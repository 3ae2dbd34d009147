"""Ray shells of the executors, and the executor group's Ray backend.

``PrimaryExecutorActor`` and ``CPUExecutorActor`` wrap ``runtime.primary.PrimaryExecutor`` and
``runtime.cpu_executor.CPUExecutor``: distinct classes per role, so the dashboard's ``Component``
label (the class name) says the role; actor names say role and device. An actor starts empty
(``RayBackend.start``, while the coordinator still solves the placement) and ``load`` builds the
real executor inside it, after Ray has set CUDA_VISIBLE_DEVICES. Ray carries control only (the
group's start script, stats, stop); the per-layer data goes through the shared-memory channel
and the steps through the step link. Metrics (``ray.util.metrics``) are tagged by actor and
device and show on the node's /metrics endpoint and in the dashboard.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util import metrics
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..runtime.steplink import StepClient, StepServer

if TYPE_CHECKING:
    from ..runtime.channel import ChannelSpec
    from ..runtime.group import ExecutorGroup, GroupSpec, StepFn
    from ..runtime.plan import Plan, Swap

log = logging.getLogger(__name__)
TAGS = ("actor", "device")


class ExecutorMetrics:
    """The per-device load the dashboard shows; values mirror ``stats()``."""

    def __init__(self, actor: str, device: str) -> None:
        self.tags = {"actor": actor, "device": device}
        m = metrics
        self.neurons = m.Counter("powerinfer_neurons_computed", "FFN (token, neuron) pairs computed", TAGS)
        self.bytes = m.Counter("powerinfer_active_bytes_read", "weight bytes of the active neurons read", TAGS)
        self.busy = m.Counter("powerinfer_busy_seconds", "seconds spent computing", TAGS)
        self.tok_s = m.Gauge("powerinfer_tokens_per_second", "tokens per second over the last step", TAGS)
        self.mem = m.Gauge("powerinfer_memory_used_bytes", "weights + KV cache held", TAGS)
        self.budget = m.Gauge("powerinfer_memory_budget_bytes", "the VRAM budget (GPU executor)", TAGS)
        self.share = m.Gauge("powerinfer_gpu_activation_share", "share of activated neurons computed on the GPU", TAGS)
        self.sync = m.Gauge("powerinfer_sync_us_per_exchange", "CPU-GPU synchronisation per layer exchange", TAGS)
        self._last: dict[str, float] = {}

    def update(self, st: dict[str, Any]) -> None:
        t = self.tags
        for counter, key in ((self.neurons, "neurons"), (self.bytes, "active_bytes"), (self.busy, "busy_s")):
            delta = float(st.get(key, 0)) - self._last.get(key, 0.0)
            if delta > 0:
                counter.inc(delta, tags=t)
            self._last[key] = float(st.get(key, 0))
        if "gpu_activation_share" in st:
            self.share.set(st["gpu_activation_share"], tags=t)
        if st.get("per_exchange_sync_us"):
            self.sync.set(st["per_exchange_sync_us"], tags=t)


class LoadedLater:
    """An executor's actor is started empty (its process and imports, and a CUDA context: what can
    run while the coordinator still solves the placement); ``load`` then builds the executor. A
    load that failed is raised again by ``loaded``, which ready() calls: the group waits on ready()."""

    impl: Any = None
    load_error: BaseException | None = None
    marks: dict[str, float]  # wall clock: __init__ began (its class loaded) and ended, load began and ended

    def _started(self, init_at: float) -> None:
        self.marks = {"init": init_at, "started": time.time()}

    def _load(self, make: Any) -> None:  # noqa: ANN401
        self.marks["load"] = time.time()
        try:
            self.impl = make()
        except BaseException as e:
            self.load_error = e
            raise
        self.marks["loaded"] = time.time()

    def loaded(self) -> Any:  # noqa: ANN401
        if self.impl is None:
            raise self.load_error or RuntimeError(f"{type(self).__name__} was never loaded")
        return self.impl


@ray.remote
class PrimaryExecutorActor(LoadedLater):
    """The primary executor: the only process that drives its GPU (or the CPU primary)."""

    def __init__(self, name: str, device: str, budget_bytes: int | None = None) -> None:
        t0 = time.time()
        logging.basicConfig(level=logging.INFO)
        self.name, self.budget = name, budget_bytes
        self.link: StepServer | None = None
        from ..runtime.primary import PrimaryExecutor  # torch and the runtime, while the plan is solved

        self.make = PrimaryExecutor
        if device == "cuda":
            import torch

            torch.zeros(1, device="cuda")
        self._started(t0)

    def load(self, model: Any, plan: Plan, **kw: Any) -> None:  # noqa: ANN401
        self._load(lambda: self.make(model, plan, **kw))
        self.device = str(self.impl.device)
        self.metrics = ExecutorMetrics(self.name, self.device)
        self.metrics.mem.set(self.impl.weight_bytes(), tags=self.metrics.tags)
        if self.budget:
            self.metrics.budget.set(self.budget, tags=self.metrics.tags)

    def ready(self) -> dict[str, Any]:
        impl = self.loaded()
        return {**impl.ready(), "pid": os.getpid(), "vram_used_bytes": _vram_used(impl.device), "marks": self.marks}

    def open_step_link(self) -> str:
        """Serve `step` over a Unix socket (runtime.steplink); its path."""
        if self.link is None:
            self.link = StepServer(self.step, name="step")
        return str(self.link.path)

    def create_channel(self) -> ChannelSpec | None:
        return self.impl.create_channel()

    def attach_cold(self, spec: Any) -> str | None:  # noqa: ANN401
        """The CPU shard's rows for dense prefill (the CPU executor's shared pages, or a copy)."""
        return self.impl.attach_cold(spec)

    def fill_cold(self, spec: Any) -> None:  # noqa: ANN401
        """Make the CPU executor's rows here and write them into its shared file."""
        self.impl.fill_cold(spec)

    def capture_graphs(self) -> dict[int, float]:
        """The decode graphs of every batch-size bucket, before serving (seconds per bucket)."""
        return self.impl.capture_graphs()

    def step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int], burst=None):  # noqa: ANN001, ANN201
        """A step's logits [B, V]; burst (a ``sampling.Burst``): its decode steps back to back, their
        tokens [n, B] and the samplers' states (``PrimaryExecutor.serve_step``)."""
        t0 = time.perf_counter()
        out = self.impl.serve_step(slots, tokens, start_pos, burst)
        dt = time.perf_counter() - t0
        n_tok = sum(len(t) for t in tokens) * (burst.n if burst else 1)
        self.metrics.tok_s.set(n_tok / dt if dt > 0 else 0.0, tags=self.metrics.tags)
        if self.impl.stats.steps % 8 == 1:
            self.metrics.update(self.stats())
        return out

    def stats(self, peer_neurons: int | None = None) -> dict[str, Any]:
        """Counters; ``peer_neurons`` (the CPU executor's) completes the GPU share of activations."""
        from ..runtime.hostmem import process_memory

        if peer_neurons is not None:
            self.impl.stats.peer_neurons = peer_neurons
        st = self.impl.stats.as_dict()
        st.update(name=self.name, device=self.device, weight_bytes=self.impl.weight_bytes(),
                  read_bytes_per_step=self.impl.read_bytes_per_step(),
                  vram_used_bytes=_vram_used(self.impl.device), vram_peak_bytes=_vram_used(self.impl.device, peak=True),
                  vram_budget_bytes=self.budget,
                  memory=process_memory())
        return st

    def activation_counts(self, reset: bool = False) -> tuple[Any, int]:
        """Its activation counts [L, n_ff] and the tokens counted (``runtime.activity``)."""
        return self.impl.activation_counts(reset)

    def activity_totals(self) -> tuple[int, int]:
        return self.impl.activity_totals()

    def swap(self, pause: list[Swap]) -> None:
        """Re-placement, between steps (the engine holds its step lock): ``PrimaryExecutor.swap``."""
        self.impl.swap(pause)

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
        if self.impl is not None:
            self.impl.close()


@ray.remote
class CPUExecutorActor(LoadedLater):
    """Cold neurons and CPU-placed heads; serves the channel in a background thread."""

    def __init__(self, name: str) -> None:
        t0 = time.time()
        logging.basicConfig(level=logging.INFO)
        self.name = name
        from ..kernels.cpu_library import build_in_background
        from ..runtime.cpu_executor import CPUExecutor  # torch and the runtime, while the plan is solved

        build_in_background()  # the compiled kernels too (a host's first start compiles them: seconds)
        self.make = CPUExecutor
        self._started(t0)

    def load(self, model: Any, plan: Plan, **kw: Any) -> None:  # noqa: ANN401
        self._load(lambda: self.make(model, plan, **kw))
        self.metrics = ExecutorMetrics(self.name, "cpu")
        self.metrics.mem.set(self.impl.weight_bytes(), tags=self.metrics.tags)

    def ready(self) -> dict[str, Any]:
        return {**self.loaded().ready(), "pid": os.getpid(), "marks": self.marks}

    def filled(self, by_primary: bool = True) -> None:
        """The primary wrote the shared rows (ready()'s needs_fill): touch them before serving;
        by_primary False: write them here."""
        self.impl.filled(by_primary)

    def set_threads(self, n: int) -> int:
        return self.impl.set_threads(n)

    def attach(self, spec: ChannelSpec) -> int:
        """Map the channel and serve it (in the executor's worker thread)."""
        return self.impl.attach(spec)

    def activation_counts(self, reset: bool = False) -> Any:  # noqa: ANN401  (numpy [L, n_ff])
        """The true activity counts of its neurons (policy 'oracle'; ``runtime.activity``)."""
        return self.impl.activation_counts(reset)

    def activity_active(self) -> int:
        return self.impl.activity.active()

    def swap(self, pause: list[Swap]) -> None:
        """Re-placement, between steps (the engine holds its step lock): ``CPUExecutor.swap``."""
        self.impl.swap(pause)

    def stats(self) -> dict[str, Any]:
        st = self.impl.stats.as_dict()
        st.pop("gpu_activation_share", None)
        st.update(name=self.name, device="cpu", weight_bytes=self.impl.weight_bytes(), threads=self.impl.threads,
                  error=self.impl.error, memory=self.impl.memory())
        self.metrics.update(st)
        return st


class RayBackend:
    """The executor group (``runtime.group``) as Ray actors named after their engine: one
    primary per GPU (or the CPU primary), one CPU executor reserving a CPU per thread. An engine
    in a placement group (a replica: ``actors.replicas``) starts them in its bundle, so that they
    share its node, and the primary takes the bundle's share of a GPU."""

    task_error = ray.exceptions.RayTaskError

    def __init__(self, engine_name: str, budget_bytes: int | None = None,
                 placement: PlacementGroup | None = None) -> None:
        self.engine_name, self.budget_bytes = engine_name, budget_bytes
        self.placement = placement if placement is not None else get_current_placement_group()
        self.link: StepClient | None = None
        self.started: dict[str, Any] = {}  # role -> an actor started before its spec was known

    def member_options(self, role: str, device: str, threads: int) -> dict[str, Any]:
        """A member's actor options: its resources, and bundle 0 of the engine's placement group."""
        if role == "cpu":
            opts: dict[str, Any] = {"num_cpus": threads}
        else:
            opts = {"num_cpus": 1, "num_gpus": self._gpus() if device == "cuda" else 0}
        if self.placement is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.placement,
                                                                           placement_group_bundle_index=0)
        return opts

    def _gpus(self) -> float:
        """The primary's GPUs: one, or the bundle's share of one."""
        if self.placement is None:
            return 1
        gpus = self.placement.bundle_specs[0].get("GPU", 0)
        if gpus <= 0:
            raise ValueError(f"device='cuda': the placement group of {self.engine_name} reserves no GPU "
                             f"(bundle {self.placement.bundle_specs[0]})")
        return gpus

    def start(self, role: str, device: str, threads: int) -> Any:  # noqa: ANN401
        """Start a member's process now; it loads when ``create`` hands it the spec."""
        opts = self.member_options(role, device, threads)
        if role == "primary":
            name = f"{self.engine_name}.gpu-executor.{'cuda0' if device == 'cuda' else 'cpu'}"
            actor = PrimaryExecutorActor.options(name=name, **opts).remote(name, device, budget_bytes=self.budget_bytes)
        else:
            name = f"{self.engine_name}.cpu-executor.0"
            actor = CPUExecutorActor.options(name=name, **opts).remote(name)
        self.started[role] = actor
        return actor

    def create(self, role: str, spec: GroupSpec) -> Any:  # noqa: ANN401
        if not spec.plan.needs_cpu_executor:  # started early, for a split that turned out all on the GPU
            self.discard_started("cpu")
        actor = self.started.pop(role, None) or self.start(role, spec.device, spec.threads)
        kw = spec.primary_kwargs() if role == "primary" else spec.cpu_kwargs()
        actor.load.remote(spec.model, spec.plan, **kw)  # runs before any later call of the group's
        return actor

    def discard_started(self, *roles: str) -> None:
        """Kill the members of these roles (default: all) started but not created."""
        for role in roles or list(self.started):
            actor = self.started.pop(role, None)
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def call(self, calls: list[tuple[Any, str, tuple]]) -> list[Any]:
        return ray.get([getattr(member, method).remote(*args) for member, method, args in calls])

    def step_fn(self, primary: Any) -> StepFn:  # noqa: ANN401
        """Steps over the primary's step link (Ray's per-call cost off every token)."""
        self.link = StepClient(ray.get(primary.open_step_link.remote()))
        return self.link.call

    def close(self, group: ExecutorGroup) -> None:
        """Kill the actors (those started for the group too); the dead primary cannot remove its
        channel's file, so do it here."""
        self.discard_started()
        for a in (group.primary, group.cpu):
            if a is not None:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001  (already dead)
                    pass
        group.primary = group.cpu = None
        if group.channel is not None:
            group.channel.path.unlink(missing_ok=True)
        if self.link is not None:
            self.link.close()  # (its socket has no file: runtime/steplink.py)
            self.link = None


def _vram_used(device: Any, peak: bool = False) -> int:  # noqa: ANN401
    """Bytes torch has allocated on a CUDA device now (peak: the most since the process started)."""
    import torch

    if getattr(device, "type", "") != "cuda":
        return 0
    return int(torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device))
