"""The engine users hold: a plain named (optionally detached) Ray actor.

    engine = Coordinator.options(name="powerinfer-engine").remote("model.gguf", vram_budget_gib=16)
    ray.get(engine.generate.remote("Hello", max_tokens=32, temperature=0.8))
    for chunk in engine.generate_stream.remote("Hello"): print(ray.get(chunk)["text"], end="")

Its keyword options are the fields of ``runtime.config.EngineConfig``. It starts the executor
group for its plan on Ray actors (``runtime.group.start_group`` with ``executors.RayBackend``: one
primary executor per GPU, one CPU executor, their shared-memory channel) and runs the request
loop (``runtime.scheduler.Scheduler``), talking to the primary once per step over the step link
(a Unix socket the primary opens, ``runtime.steplink``). When an executor dies, in-flight
requests fail with a clear error, the executors are rebuilt and the next request is served.
When the engine itself dies, Ray restarts it (``max_restarts=-1``) under the same name and handle.
With re-placement on (``runtime.replacement``) a task beside the request loop has the executors
swap neurons between steps; restarted executors load the split as it then is.
Several engines serve one app as replicas (``actors.replicas``): each in a placement group of its
own, whose bundle its executors join.

The module imports no torch (the runtime is imported inside the methods that use it): a worker
loading the class (Ray ships it with the modules its methods name) starts it without torch, and
its ``__init__`` starts the executors' processes before it imports the runtime, so their imports
(torch takes seconds) run beside its own.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import ray
from ray.util import metrics

from ..runtime.config import EngineConfig, engine_n_ctx, resolve_plan, resolve_policy, resolve_prefill_chunk
from .executors import RayBackend

if TYPE_CHECKING:
    from ..offline.profile import ActivationStats
    from ..runtime.group import ExecutorGroup
    from ..runtime.plan import Swap
    from ..runtime.replacement import Replacer
    from ..runtime.scheduler import Request

log = logging.getLogger(__name__)
DEFAULT_NAME = "powerinfer-engine"


# seconds: histogram buckets of time to first token / in the queue, and of time per output token
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


@ray.remote(max_restarts=-1)
class Coordinator:
    def __init__(self, model: str | None = None, *, name: str | None = None, **options: Any) -> None:
        self.started_at = time.time()  # wall clock: a caller on this host subtracts its own start
        logging.basicConfig(level=logging.INFO)
        if model is None:
            from ..model.default import default_model_path

            model = str(default_model_path())
        self.ec = EngineConfig.from_options(str(model), **options)
        # the executors are named after the engine: its own actor name unless given, so two
        # engines in one cluster never collide
        self.name = name or ray.get_runtime_context().get_actor_name() or DEFAULT_NAME
        self._check_device()
        self.device = self._device()
        self.group: ExecutorGroup | None = None
        self.restarts = 0
        # the members' processes start first (Ray's workers, their imports, a CUDA context): their
        # imports run beside this one's of the runtime and torch (deferred to here: the module
        # itself stays light) and the placement's solve; the CPU executor's when a budget makes a
        # hybrid split likely
        self.backend: RayBackend | None = RayBackend(self.name, self.ec.vram_budget_bytes)
        threads, fits = self._cpu_threads()
        for role in ("primary", "cpu") if self._cpu_executor_likely() and fits else ("primary",):
            try:
                self.backend.start(role, self.device, threads)
            except ValueError:  # the name is still held by a predecessor: started with the group
                pass
        try:
            from ..model.source import open_model
            from ..runtime.engine import executor_spec, make_tokenizer
            from ..runtime.replacement import ReplacementLoop, engine_replacer
            from ..runtime.scheduler import Scheduler

            self.src = src = open_model(self.ec.model)  # kept: the executors' start checks it (restarts too)
            self.cfg = src.config
            self.model_name = self.cfg.name or str(model)
            self.n_ctx = engine_n_ctx(self.ec, self.cfg)
            self.policy = resolve_policy(self.ec, self.cfg)
            t0 = time.perf_counter()
            self.plan = resolve_plan(self.ec, src)
            self.plan_s = time.perf_counter() - t0
            if self.plan.needs_cpu_executor and not fits:  # it would wait forever for CPUs
                n_cpus = int(ray.cluster_resources().get("CPU", 2))
                raise ValueError(f"threads={threads}: the CPU executor reserves one CPU per thread and the GPU "
                                 f"executor one more, but the Ray cluster has {n_cpus} CPUs; use threads <= "
                                 f"{n_cpus - 1} (or start Ray with more CPUs)")
            self.tokenizer = make_tokenizer(src.fields)
            self.prefill_chunk = resolve_prefill_chunk(self.ec, self.device, self.cfg)
            self.spec = executor_spec(self.ec, src, self.plan, self.device, threads=threads)
            self.replacer = engine_replacer(self.ec, src, self.plan, self.policy)
        except BaseException:  # the members started stop with this start (an actor still waiting for
            self.backend.discard_started()  # resources would hold this one's end)
            raise
        self._start_named_executors()
        self._step_lock = asyncio.Lock()  # held by a step: counts are read, neurons swapped between steps
        self.core = Scheduler(self._step, self.tokenizer, n_ctx=self.n_ctx, max_batch=self.ec.max_batch,
                              prefill_chunk=self.prefill_chunk, max_waiting=self.ec.max_waiting,
                              decode_burst=self.ec.decode_burst,
                              n_vocab=self.cfg.n_vocab, on_failure=self._recover, on_finish=self._observe)
        self._metrics()
        self.replacement = ReplacementLoop(self.replacer, self._totals, self._swap, self._replaced) \
            if self.replacer is not None else None
        self.init_s = time.time() - self.started_at

    def _cpu_executor_likely(self) -> bool:
        """Whether the plan gives the CPU executor work: known when the plan came solved (the
        command line, replicas), likely when a budget is to be solved for."""
        return self.ec.plan.needs_cpu_executor if self.ec.plan is not None else bool(self.ec.vram_budget_bytes)

    def _check_device(self) -> None:
        """A CUDA primary needs a GPU in the cluster: without one its actor would wait forever."""
        if self.ec.device == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
            raise ValueError("device='cuda': the Ray cluster has no GPU; use device='cpu' (or leave it out)")

    def _start_named_executors(self) -> None:
        """Start the executors; after a restart of this actor the dead executors' names are
        released asynchronously: wait for them. Their channel files are swept afterwards."""
        for attempt in range(100):
            try:
                self._start_executors()
                break
            except ValueError as e:  # "actor name already taken"
                if "already" not in str(e) or attempt == 99:
                    raise
                time.sleep(0.2)
        from ..runtime.shmfiles import sweep_stale

        sweep_stale()

    def _metrics(self) -> None:
        tags = ("engine",)
        self.m_tokens = metrics.Counter("powerinfer_generated_tokens", "tokens generated", tags)
        self.m_requests = metrics.Gauge("powerinfer_running_requests", "requests being decoded", tags)
        self.m_ttft = metrics.Histogram("powerinfer_time_to_first_token_seconds", "time to first token",
                                        LATENCY_BUCKETS, tags)
        self.m_tpot = metrics.Histogram("powerinfer_time_per_output_token_seconds",
                                        "time per output token after the first", TPOT_BUCKETS, tags)
        self.m_queue = metrics.Histogram("powerinfer_queue_time_seconds", "time from arrival to a batch slot",
                                         LATENCY_BUCKETS, tags)
        self.m_swaps = metrics.Counter("powerinfer_replacement_swaps", "re-placements applied (splits re-solved "
                                       "from served traffic that moved neurons)", tags)
        self.m_moved = metrics.Counter("powerinfer_replacement_neurons_moved", "neurons moved between the GPU "
                                       "and the CPU by re-placement", tags)
        self.m_share = metrics.Gauge("powerinfer_gpu_activation_share_recent", "share of the last re-placement "
                                     "interval's activations on the GPU's neurons", tags)
        self._reported = {"accepted": 0, "neurons_moved": 0}

    def _observe(self, req: Request) -> None:
        t, tags = req.timings(), {"engine": self.name}
        for metric, key in ((self.m_ttft, "ttft_s"), (self.m_tpot, "tpot_s"), (self.m_queue, "queue_s")):
            if t[key] is not None:
                metric.observe(t[key], tags=tags)

    # --- executors ---------------------------------------------------------------------------
    def _device(self) -> str:
        if self.ec.device:
            return self.ec.device
        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"

    def _cpu_threads(self) -> tuple[int, bool]:
        """The CPU executor's threads (all the cluster's CPUs but the primary's and one more,
        unless set), and whether the cluster has them: it reserves one CPU per thread."""
        n_cpus = int(ray.cluster_resources().get("CPU", 2))
        threads = self.ec.threads or max(1, n_cpus - 2)
        return threads, threads + 1 <= n_cpus

    def _start_executors(self) -> None:
        import dataclasses

        from ..runtime.group import start_group

        if self.replacer is not None:  # the split as re-placement has left it
            self.spec = dataclasses.replace(self.spec, plan=self.replacer.plan)
        backend, self.backend = self.backend or RayBackend(self.name, self.ec.vram_budget_bytes), None
        self.group = start_group(backend, self.spec, self.src)

    def _kill_executors(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    async def _recover(self, exc: BaseException) -> None:
        log.error("executor failure (%s): restarting the executors", exc)
        self._kill_executors()
        self.restarts += 1
        for _ in range(50):  # the old names are released asynchronously
            try:
                await asyncio.to_thread(self._start_executors)
                return
            except ValueError as e:  # "actor name already taken"
                if "already" not in str(e):
                    raise
                await asyncio.sleep(0.2)

    async def _step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int], burst=None):  # noqa: ANN001, ANN202
        """A step on the running executors (burst: a ``sampling.Burst``, its decode steps back to back)."""
        n = burst.n if burst else 1
        async with self._step_lock:
            out = await self._running().step(slots, tokens, start_pos, burst)
        self.m_tokens.inc(len(tokens) * n, tags={"engine": self.name})
        if self.replacement is not None:
            self.replacement.stepped(tokens, n)
        return out

    # --- re-placement (runtime/replacement.py): both executors, between steps ------------------------
    async def _counts(self, reset: bool = False) -> tuple[list[Any], int]:
        """Each executor's activation counts [L, n_ff] and the tokens counted, between steps."""
        from ..runtime.activity import cpu_counts  # imports torch: the executors start first

        async with self._step_lock:
            g = self._running()
            cpu = g.cpu if cpu_counts(self.policy) else None
            parts = await asyncio.gather(*[m.activation_counts.remote(reset) for m in (g.primary, cpu) if m is not None])
            (counts, tokens), rest = parts[0], list(parts[1:])
            return [counts] + rest, tokens

    async def _totals(self) -> tuple[Any, int]:
        parts, tokens = await self._counts()
        return sum(parts), tokens

    async def _swap(self, pause: list[Swap]) -> None:
        async with self._step_lock:
            g = self._running()
            await asyncio.gather(*[m.swap.remote(pause) for m in (g.primary, g.cpu) if m is not None])

    def _replaced(self, r: Replacer) -> None:
        """Re-placement's metrics (the counters' growth since the last report)."""
        tags = {"engine": self.name}
        for metric, key in ((self.m_swaps, "accepted"), (self.m_moved, "neurons_moved")):
            grown = r.counters[key] - self._reported[key]
            if grown > 0:
                metric.inc(grown, tags=tags)
            self._reported[key] = r.counters[key]
        if r.history:
            self.m_share.set(r.history[-1]["gpu_share"], tags=tags)

    # --- the API users call ---------------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | None = None, **kw: Any) -> dict[str, Any]:
        """Text, token ids and stats of one completion (sampling keywords: see SamplingParams)."""
        return await self.core.generate(prompt, **kw)

    async def generate_stream(self, prompt: str | list[int] | None = None, **kw: Any) -> AsyncIterator[dict]:
        """The same as a Ray streaming generator of chunks {"text", "token_ids", "finish_reason"}."""
        async for chunk in self.core.generate_stream(prompt, **kw):
            yield chunk

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def ready(self) -> dict[str, Any]:
        g = self.group
        return {"model": self.model_name, "n_ctx": self.n_ctx, "policy": self.policy, "device": self.device,
                "prefill_chunk": self.prefill_chunk, "executors": ["gpu"] + (["cpu"] if g and g.cpu else []), "plan_s": self.plan_s,
                "started_at": self.started_at, "init_s": self.init_s,
                "load_s": g.load_s if g else {}, "dense_prefill": g.dense_prefill if g else None,
                "pid": os.getpid(), "name": self.name, "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(),
                # each executor's load phases and memory at its start (its ready() without the shard layout)
                "executors_ready": [{k: v for k, v in i.items() if k != "shard_spec"} for i in g.ready] if g else []}

    def model_info(self) -> dict[str, Any]:
        return {"name": self.model_name, "engine": self.name, "n_ctx": self.n_ctx, "n_vocab": self.cfg.n_vocab,
                "chat_template": self.tokenizer.chat_template if self.tokenizer else None,
                "has_tokenizer": self.tokenizer is not None, **self._special_tokens()}

    def _special_tokens(self) -> dict[str, Any]:
        """BOS/EOS as text (for chat templates) and whether encode() adds BOS itself."""
        tok = self.tokenizer
        if tok is None:
            return {"bos_token": None, "eos_token": None, "add_bos": False}
        bos, eos = (None if i is None else tok.tok.id_to_token(i) for i in (tok.bos_id, tok.eos_id))
        return {"bos_token": bos, "eos_token": eos, "add_bos": tok.add_bos}

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS when the model adds it and add_special_tokens), in a worker
        thread; text longer than the context could hold is refused, as a prompt is."""
        text = self.core.prompts.check_text(text)
        return await asyncio.to_thread(self.tokenizer.encode, text, None if add_special_tokens else False)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens skipped), in a worker thread."""
        ids = self.core.prompts.check_ids(token_ids)
        if self.tokenizer is None:
            raise ValueError("token_ids: this model has no tokenizer")
        return await asyncio.to_thread(self.tokenizer.decode, ids)

    async def stats(self) -> dict[str, Any]:
        """Scheduler counters and each executor's load (neurons, bytes, busy s, sync, memory)."""
        from ..runtime.activity import activity_summary
        from ..runtime.hostmem import process_memory

        g = self._running()
        link = getattr(g.backend, "link", None)  # the step link's time there, in the step and back
        link = {f"link_{k}": v for k, v in link.times.items()} if link is not None else {}
        out: dict[str, Any] = {"coordinator": {**self.core.stats(), **link, "memory": process_memory()},
                               "restarts": self.restarts, "policy": self.policy, "n_ctx": self.n_ctx,
                               "device": self.device}
        peer = None
        if g.cpu is not None:
            out["cpu_executor"] = await g.cpu.stats.remote()
            peer = out["cpu_executor"]["neurons"]
        out["gpu_executor"] = await g.primary.stats.remote(peer)
        tokens, active = await g.primary.activity_totals.remote()
        active += await g.cpu.activity_active.remote() if g.cpu is not None else 0
        out["activation"] = activity_summary(self.policy, tokens, active, self.cfg.n_layer, self.cfg.n_ff)
        out["replacement"] = self.replacer.stats() if self.replacer is not None else {"on": False}
        self.m_requests.set(out["coordinator"]["running"], tags={"engine": self.name})
        return out

    async def activation_stats(self, reset: bool = False) -> ActivationStats:
        """The activation counts of every token the engine has run since its executors started
        (``runtime.activity``) as the profile's statistics; reset: start counting afresh.
        ValueError under a policy that keeps no counts."""
        from ..runtime.activity import check_counted, engine_activation

        check_counted(self.policy)
        parts, tokens = await self._counts(reset)  # between steps: both executors' counts of the same tokens
        return engine_activation(parts, tokens, self.model_name)

    async def save_activation(self, out_dir: str, reset: bool = False) -> dict[str, Any]:
        """Write the counts to ``out_dir`` (activation.parquet and activation/activation_{l}.pt,
        which ``powerinfer-ray solve --activation out_dir`` reads); their summary and the folder."""
        st = await self.activation_stats(reset)
        path = st.save(out_dir)
        return {"path": str(path), "n_tokens": st.n_tokens,
                "mean_active_fraction": float(st.active_fraction().mean()) if st.n_tokens else 0.0}

    async def set_cpu_threads(self, n: int) -> int:
        """Threads of the CPU executor's kernels from the next layer on (no reload): for tuning
        and thread sweeps. The actor keeps the CPUs it reserved at start."""
        if not self.plan.needs_cpu_executor:
            raise ValueError("this engine's plan has no CPU executor")
        return await self._running().cpu.set_threads.remote(n)

    def executor_handles(self) -> dict[str, Any]:
        """The executor actors (for operations and fault tests)."""
        g = self._running()
        return {"gpu": g.primary, "cpu": g.cpu}

    def _running(self) -> ExecutorGroup:
        if self.group is None:
            raise RuntimeError("the executors are not running (their restart failed; see the engine's log)")
        return self.group

    def shutdown(self) -> None:
        self._kill_executors()
