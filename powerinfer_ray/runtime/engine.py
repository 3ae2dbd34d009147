"""Engine configuration, the layer plan it runs with, and an in-process engine.

``resolve_plan`` turns a VRAM budget into a Plan the way upstream PowerInfer does: reuse the
cached split file ``<model>.generated.gpuidx`` unless told to re-solve, otherwise solve the
placement (ILP, cvxpy + HiGHS) from the model's activation statistics and cache the result.

``LocalEngine`` runs the primary executor, the CPU executor (a thread over the same
shared-memory channel) and the coordinator in one process: the runtime without Ray, for tests
and for embedding. The Ray engine (``actors.Coordinator``) wires the same classes as actors.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..model.config import ModelConfig
from ..model.costs import model_costs
from ..model.source import WeightSource, open_model
from ..model import gguf_keys as K
from ..model.tokenizer import Tokenizer
from .coordinator import Coordinator
from .executor import CPUExecutor, PrimaryExecutor
from .plan import Plan

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
    statistics (``Plan.hot_first``; $POWERINFER_RAY_CPU_ORDER=id: ascending ids, as before)."""
    order = os.environ.get("POWERINFER_RAY_CPU_ORDER", "hot")
    if order not in ("id", "hot"):
        raise ValueError(f"POWERINFER_RAY_CPU_ORDER={order!r}: expected 'hot' (the default) or 'id' "
                         "(ascending neuron ids)")
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
    return plan.hot_first(stats[0]) if stats is not None and order == "hot" else plan


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
# the in-process engine
# ------------------------------------------------------------------------------------------------
@dataclass
class LocalEngine:
    """Primary + CPU executor (thread) + coordinator in one process."""

    config: EngineConfig
    primary: PrimaryExecutor = field(init=False)
    cpu: CPUExecutor | None = field(init=False, default=None)
    coordinator: Coordinator = field(init=False)

    def __post_init__(self) -> None:
        ec = self.config
        src = open_model(ec.model)
        cfg = src.config
        plan = resolve_plan(ec, src)
        n_ctx, policy = engine_n_ctx(ec, cfg), resolve_policy(ec, cfg)
        device = ec.device or ("cuda" if _cuda() else "cpu")
        chunk = resolve_prefill_chunk(ec, device)
        t_max = max(chunk, ec.max_batch)
        self.primary = PrimaryExecutor(src, plan, device=device, policy=policy, threshold=ec.threshold,
                                       slots=ec.max_batch, n_ctx=n_ctx, t_max=t_max, dtype=ec.dtype,
                                       timeout_s=ec.timeout_s, prefill_dense_min=ec.prefill_dense_min,
                                       graphs=ec.graphs)
        spec = self.primary.create_channel()
        if spec is not None:
            self.cpu = CPUExecutor(src, plan, policy=policy, slots=ec.max_batch, n_ctx=n_ctx, threads=ec.threads)
            self.cpu.attach(spec)
            self.cpu.start()
            self.primary.attach_cold(self.cpu.shard_spec)
        tok = make_tokenizer(src.fields)
        self.coordinator = Coordinator(self._step, tok, n_ctx=n_ctx, max_batch=ec.max_batch,
                                       prefill_chunk=chunk)

    async def _step(self, slots: list[int], tokens: list[list[int]], start: list[int]) -> np.ndarray:
        return await asyncio.to_thread(self.primary.step, slots, tokens, start)

    async def generate(self, prompt: Any = None, **kw: Any) -> dict:
        return await self.coordinator.generate(prompt, **kw)

    def stats(self) -> dict:
        s = {"coordinator": self.coordinator.stats()}
        if self.cpu is not None:
            s["cpu"] = self.cpu.stats.as_dict()
            self.primary.stats.peer_neurons = self.cpu.stats.neurons  # for the GPU share
        s["primary"] = self.primary.stats.as_dict()
        return s

    def close(self) -> None:
        if self.cpu is not None and self.primary.channel is not None:
            from .channel import OP_STOP

            seq = self.primary.channel.post(OP_STOP, 0, 0, 0, 0)
            self.primary.channel.wait_response(seq, timeout_s=5)
            self.cpu.stop()
        self.primary.close()


def make_tokenizer(fields: dict[str, Any]) -> Tokenizer | None:
    """The model's tokenizer, or None when its metadata holds none (prompts must be token ids)."""
    return Tokenizer(fields) if fields.get(K.TOK_HF_JSON) or fields.get(K.TOK_TOKENS) else None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
