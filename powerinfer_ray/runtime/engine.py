"""The executors of an engine, and the in-process engine (its configuration and plan:
``runtime.config``).

``executor_spec`` says what an engine's executors are built from; ``LocalEngine`` starts them in
one process (``group.LocalBackend``: the CPU executor serves the same shared-memory channel from
a thread) with the scheduler: the runtime without Ray, for tests and for embedding. The Ray
engine (``actors.coordinator.Coordinator``) runs the same start script on Ray actors. Both run
re-placement (``replacement.ReplacementLoop``) beside the request loop when it is on.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Coroutine

from ..model.source import WeightSource, open_model, rows_faster_on
from ..model import gguf_keys as K
from ..model.tokenizer import Tokenizer
from .activity import activity_summary, check_counted, cpu_counts, engine_activation
from .config import EngineConfig, engine_n_ctx, resolve_plan, resolve_policy, resolve_prefill_chunk
from .cpu_executor import CPUExecutor
from .group import ExecutorGroup, GroupSpec, LocalBackend, start_group
from .plan import Plan, Swap
from .primary import PrimaryExecutor
from .replacement import ReplacementLoop, engine_replacer
from .sampling import Burst
from .scheduler import Scheduler

if TYPE_CHECKING:
    from ..offline.profile import ActivationStats

log = logging.getLogger(__name__)


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
                     t_max=max(resolve_prefill_chunk(ec, device, cfg), ec.max_batch), threads=threads,
                     threshold=ec.threshold, margin=ec.predictor_margin, dtype=ec.dtype, timeout_s=ec.timeout_s,
                     prefill_dense_min=ec.prefill_dense_min, graphs=ec.graphs, zero_copy=ec.zero_copy,
                     prefill_share=ec.prefill_share,
                     primary_fills=rows_faster_on(src, device))


class LocalEngine:
    """The executors and the scheduler in this process. The scheduler runs in an event loop
    of the engine's own thread, so any event loop can drive the engine (several, one after
    another or at once): ``await engine.generate(...)``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = ec = config
        src = open_model(ec.model)
        plan = resolve_plan(ec, src)
        device = ec.device or ("cuda" if _cuda() else "cpu")
        self._backend = LocalBackend()  # its step lock: activation counts are read between steps
        self.group: ExecutorGroup = start_group(self._backend, executor_spec(ec, src, plan, device, model=src,
                                                                             threads=ec.threads))
        self.primary: PrimaryExecutor = self.group.primary
        self.cpu: CPUExecutor | None = self.group.cpu
        self.replacer = engine_replacer(ec, src, plan, self.primary.policy.name)
        self.replacement = ReplacementLoop(self.replacer, self._totals, self._swap) if self.replacer else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-engine", daemon=True)
        self._thread.start()
        tok, n_ctx, chunk = make_tokenizer(src.fields), engine_n_ctx(ec, src.config), resolve_prefill_chunk(ec, device, src.config)

        async def make() -> Scheduler:  # its queues belong to the engine's loop
            return Scheduler(self._step, tok, n_ctx=n_ctx, max_batch=ec.max_batch, prefill_chunk=chunk,
                             n_vocab=src.config.n_vocab, decode_burst=ec.decode_burst)
        self.coordinator = asyncio.run_coroutine_threadsafe(make(), self._loop).result()

    async def _step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int],
                    burst: Burst | None = None) -> Any:  # noqa: ANN401
        out = await self.group.step(slots, tokens, start_pos, burst)
        if self.replacement is not None:
            self.replacement.stepped(tokens, burst.n if burst else 1)
        return out

    # --- re-placement: both executors, between steps ----------------------------------------------
    def _counts(self, reset: bool = False) -> tuple[list[Any], int]:
        """Each executor's activation counts [L, n_ff] and the tokens counted, between steps."""
        with self._backend.step_lock:  # between steps: both executors' counts of the same tokens
            counts, tokens = self.primary.activation_counts(reset)
            counted = self.cpu is not None and cpu_counts(self.primary.policy.name)
            return [counts] + ([self.cpu.activation_counts(reset)] if counted else []), tokens

    async def _totals(self) -> tuple[Any, int]:
        parts, tokens = await asyncio.to_thread(self._counts)
        return sum(parts), tokens

    async def _swap(self, pause: list[Swap]) -> None:
        def locked() -> None:
            with self._backend.step_lock:
                self.primary.swap(pause)
                if self.cpu is not None:
                    self.cpu.swap(pause)
        await asyncio.to_thread(locked)

    async def _in_loop(self, coro: Coroutine) -> Any:  # noqa: ANN401
        """Run coro in the engine's loop; the caller's cancellation cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def generate(self, prompt: Any = None, **kw: Any) -> dict:  # noqa: ANN401
        """One completion (``runtime.scheduler.Scheduler.generate``), from any event loop."""
        if self._loop.is_closed():
            raise RuntimeError("this LocalEngine is closed")
        return await self._in_loop(self.coordinator.generate(prompt, **kw))

    def stats(self) -> dict:
        s = {"coordinator": self.coordinator.stats()}
        if self.cpu is not None:
            s["cpu"] = self.cpu.stats.as_dict()
            self.primary.stats.peer_neurons = self.cpu.stats.neurons  # for the GPU share
        s["primary"] = self.primary.stats.as_dict()
        tokens, active = self.primary.activity_totals()
        active += self.cpu.activity.active() if self.cpu is not None else 0
        cfg = self.primary.cfg
        s["activation"] = activity_summary(self.primary.policy.name, tokens, active, cfg.n_layer, cfg.n_ff)
        s["replacement"] = self.replacer.stats() if self.replacer is not None else {"on": False}
        return s

    def activation_stats(self, reset: bool = False) -> "ActivationStats":
        """The activation counts of every token this engine has run (``runtime.activity``), as
        the offline profile's statistics (``save(dir)`` writes what ``solve --activation`` reads);
        reset: start counting afresh. ValueError under a policy that keeps no counts."""
        check_counted(self.primary.policy.name)
        parts, tokens = self._counts(reset)
        return engine_activation(parts, tokens, self.primary.cfg.name)

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
