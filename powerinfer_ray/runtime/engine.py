"""The in-process engine.

``LocalEngine`` runs the primary executor, the CPU executor (a thread over the same
shared-memory channel) and the coordinator in one process: the runtime without Ray, for tests
and for embedding. The Ray engine (``actors.Coordinator``) wires the same classes as actors.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.source import open_model
from ..model import gguf_keys as K
from ..model.tokenizer import Tokenizer
from .config import EngineConfig, engine_n_ctx, resolve_plan, resolve_policy, resolve_prefill_chunk
from .executor import CPUExecutor, PrimaryExecutor
from .scheduler import Scheduler

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# the in-process engine
# ------------------------------------------------------------------------------------------------
@dataclass
class LocalEngine:
    """Primary + CPU executor (thread) + coordinator in one process."""

    config: EngineConfig
    primary: PrimaryExecutor = field(init=False)
    cpu: CPUExecutor | None = field(init=False, default=None)
    coordinator: Scheduler = field(init=False)

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
        self.coordinator = Scheduler(self._step, tok, n_ctx=n_ctx, max_batch=ec.max_batch,
                                     prefill_chunk=chunk, n_vocab=cfg.n_vocab)

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
