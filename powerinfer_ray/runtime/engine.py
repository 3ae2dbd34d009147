"""Engine configuration, the layer plan it runs with, and an in-process engine.

``resolve_plan`` turns a VRAM budget into a Plan the way upstream PowerInfer does: reuse the
cached split file ``<model>.generated.gpuidx`` unless told to re-solve, otherwise solve the
placement (ILP, cvxpy + HiGHS) from the model's activation statistics and cache the result.

``executor_spec`` says what an engine's executors are built from; ``LocalEngine`` starts them in
one process (``group.LocalBackend``: the CPU executor serves the same shared-memory channel from
a thread) with the coordinator: the runtime without Ray, for tests and for embedding. The Ray
engine (``actors.coordinator.Coordinator``) runs the same start script on Ray actors.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine

import numpy as np

from ..model.config import ModelConfig
from ..model.costs import model_costs
from ..model.source import WeightSource, open_model, rows_faster_on
from ..model import gguf_keys as K
from ..model.tokenizer import Tokenizer
from .coordinator import Coordinator
from .cpu_executor import CPUExecutor
from .group import ExecutorGroup, GroupSpec, LocalBackend, start_group
from .plan import Plan
from .primary import PrimaryExecutor

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass
class EngineConfig:
    model: str
    vram_budget_gib: float | None = None  # None: everything on the primary executor
    threads: int | None = None  # CPU executor threads
    device: str | None = None  # primary's device: None = cuda if present else cpu
    n_ctx: int | None = None  # None: min(model's context, 4096)
    max_batch: int = 8
    prefill_chunk: int | None = None  # prompt tokens per step; None: resolve_prefill_chunk
    policy: str | None = None  # predictor | oracle | dense; None: predictor if the model has them
    threshold: float | None = None  # None: the model's powerinfer.sparse_threshold
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    gpu_fraction: float | None = None  # simple split instead of the solver (tests, baselines)
    cpu_groups: int = 0  # with gpu_fraction: KV-head groups per layer on the CPU
    plan: Plan | None = None  # an explicit plan wins over everything above
    host_profile: str | None = None
    method: str = "ilp"
    timeout_s: float = 120.0
    dtype: str | None = None
    prefill_dense_min: int | None = None  # None: 32 tokens on CUDA, off on the CPU
    graphs: bool | None = None  # decode steps as CUDA graphs; None: on CUDA (CPU: True runs them eagerly)
    host_memory_gib: float | None = None  # host memory the executors may take; None: what the host has available


def engine_n_ctx(ec: EngineConfig, cfg: ModelConfig) -> int:
    n = ec.n_ctx or min(cfg.n_ctx, 4096)
    if n > cfg.n_ctx:
        raise ValueError(f"n_ctx={n} exceeds the model's context length {cfg.n_ctx}")
    return n


def resolve_prefill_chunk(ec: EngineConfig, device: str) -> int:
    """Prompt tokens per step: 256 on a CUDA primary, whose dense prefill streams the CPU shard's
    rows from host memory once per chunk (on the H200 ~75 ms per 10 layers of a 13B model at 64
    tokens: the copy, not the token count, sets the cost); 64 on the CPU, where cost grows with
    tokens and a long prompt's chunk delays the other sequences' decode steps."""
    if ec.prefill_chunk is not None:
        if ec.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={ec.prefill_chunk}: expected >= 1")
        return ec.prefill_chunk
    return 256 if device == "cuda" else 64


def resolve_policy(ec: EngineConfig, cfg: ModelConfig) -> str:
    return ec.policy or ("predictor" if cfg.has_predictors else "dense")


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def activation_counts(src: WeightSource, model_path: str) -> tuple[list[np.ndarray], int] | None:
    """The model's activation statistics: planted ones, or a profile saved next to the file."""
    if hasattr(src, "activation_counts"):
        return src.activation_counts(100_000)
    from ..offline.solve import load_counts

    base = Path(model_path)
    stem = base.name.split(".")[0]
    for cand in (base.parent / f"{stem}.activation.parquet", base.parent / "activation.parquet",
                 base.parent / "activation"):
        if cand.exists():
            return load_counts(cand)
    return None


def resolve_plan(ec: EngineConfig, src: WeightSource | None = None) -> Plan:
    """The plan an engine runs with (see the module docstring). An explicit plan is used as
    given; otherwise the CPU shard's rows go hottest first when the model has activation
    statistics (``Plan.hot_first``)."""
    src = src or open_model(ec.model)
    cfg = src.config
    if ec.plan is not None:
        ec.plan.verify(cfg)
        return ec.plan
    if ec.gpu_fraction is None and ec.vram_budget_gib is None:
        return Plan.all_gpu(cfg)
    stats = activation_counts(src, ec.model)  # read once: the split and the CPU rows' order
    if ec.gpu_fraction is not None:
        plan = Plan.hottest(cfg, ec.gpu_fraction, stats[0] if stats else None, ec.cpu_groups)
    else:
        plan = _budget_plan(ec, src, stats)
    return plan.hot_first(stats[0]) if stats is not None else plan


def _budget_plan(ec: EngineConfig, src: WeightSource, stats: tuple[list[np.ndarray], int] | None) -> Plan:
    """The ILP's split for the VRAM budget (or the cached one); stats: `activation_counts`."""
    from ..placement import gpuidx
    from ..placement.host import HostProfile
    from ..placement.solve import solve_placement

    cfg = src.config
    budget = int(ec.vram_budget_gib * GIB)
    is_file = not str(ec.model).startswith("planted:")
    cache = gpuidx.gpuidx_path(ec.model) if is_file and not ec.disable_gpu_index else None
    if cache is not None and cache.exists() and not ec.reset_gpu_index:
        split = gpuidx.read_gpuidx(cache)
        if len(split.gpu_neurons) == cfg.n_layer and split.vram_capacity <= budget:  # upstream's rule
            log.info("using cached split %s", cache)
            return Plan.from_masks([np.asarray(m, bool) for m in split.gpu_neurons], None, cfg)
        log.warning("cached split %s was solved for another model or budget: re-solving", cache)
    costs = model_costs(cfg, engine_n_ctx(ec, cfg), ec.max_batch)
    if stats is None:
        log.warning("no activation statistics for %s: placing with uniform frequencies "
                    "(run powerinfer-ray profile for a better split)", ec.model)
        stats = ([np.ones(cfg.n_ff, np.int64)] * cfg.n_layer, 1)
    placement = solve_placement(stats[0], stats[1], costs, budget, HostProfile.load(ec.host_profile),
                                method=ec.method)
    if cache is not None:
        gpuidx.write_gpuidx(cache, placement.gpu_neurons, budget)
    return Plan.from_masks(placement.gpu_neurons, list(placement.gpu_attention), cfg)


# ------------------------------------------------------------------------------------------------
# the executors, and the in-process engine
# ------------------------------------------------------------------------------------------------
def executor_spec(ec: EngineConfig, src: WeightSource, plan: Plan, device: str, *, model: Any = None,  # noqa: ANN401
                  threads: int | None = None) -> GroupSpec:
    """The executors of an engine of config ``ec`` over ``src`` with ``plan``, the primary on
    ``device``; model: what the executors open (default: ``ec.model``)."""
    cfg = src.config
    return GroupSpec(model=ec.model if model is None else model, plan=plan, device=device,
                     policy=resolve_policy(ec, cfg), slots=ec.max_batch, n_ctx=engine_n_ctx(ec, cfg),
                     t_max=max(resolve_prefill_chunk(ec, device), ec.max_batch), threads=threads,
                     threshold=ec.threshold, dtype=ec.dtype, timeout_s=ec.timeout_s,
                     prefill_dense_min=ec.prefill_dense_min, graphs=ec.graphs,
                     primary_fills=rows_faster_on(src, device),
                     host_memory_bytes=None if ec.host_memory_gib is None else int(ec.host_memory_gib * GIB))


class LocalEngine:
    """The executors and the coordinator in this process. The coordinator runs in an event loop
    of the engine's own thread, so any event loop can drive the engine (several, one after
    another or at once): ``await engine.generate(...)``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = ec = config
        src = open_model(ec.model)
        plan = resolve_plan(ec, src)
        device = ec.device or ("cuda" if _cuda() else "cpu")
        self.group: ExecutorGroup = start_group(LocalBackend(), executor_spec(ec, src, plan, device, model=src,
                                                                              threads=ec.threads))
        self.primary: PrimaryExecutor = self.group.primary
        self.cpu: CPUExecutor | None = self.group.cpu
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-engine", daemon=True)
        self._thread.start()
        tok, n_ctx, chunk = make_tokenizer(src.fields), engine_n_ctx(ec, src.config), resolve_prefill_chunk(ec, device)

        async def make() -> Coordinator:  # its queues belong to the engine's loop
            return Coordinator(self.group.step, tok, n_ctx=n_ctx, max_batch=ec.max_batch, prefill_chunk=chunk)
        self.coordinator = asyncio.run_coroutine_threadsafe(make(), self._loop).result()

    async def _in_loop(self, coro: Coroutine) -> Any:  # noqa: ANN401
        """Run coro in the engine's loop; the caller's cancellation cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def generate(self, prompt: Any = None, **kw: Any) -> dict:  # noqa: ANN401
        """One completion (``runtime.coordinator.Coordinator.generate``), from any event loop."""
        if self._loop.is_closed():
            raise RuntimeError("this LocalEngine is closed")
        return await self._in_loop(self.coordinator.generate(prompt, **kw))

    def stats(self) -> dict:
        s = {"coordinator": self.coordinator.stats()}
        if self.cpu is not None:
            s["cpu"] = self.cpu.stats.as_dict()
            self.primary.stats.peer_neurons = self.cpu.stats.neurons  # for the GPU share
        s["primary"] = self.primary.stats.as_dict()
        return s

    def close(self) -> None:
        """Stop the request loop (a step in flight finishes first) and the executors."""
        if not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
        self.group.close()


async def _cancel_all() -> None:
    """Cancel the loop's other tasks and wait for its worker threads (a step in flight)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_default_executor()


def make_tokenizer(fields: dict[str, Any]) -> Tokenizer | None:
    """The model's tokenizer, or None when its metadata holds none (prompts must be token ids)."""
    return Tokenizer(fields) if fields.get(K.TOK_HF_JSON) or fields.get(K.TOK_TOKENS) else None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
