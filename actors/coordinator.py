"""The engine users hold: a plain named (optionally detached) Ray actor.

    engine = Coordinator.options(name="powerinfer-engine").remote("model.gguf", vram_budget_gib=16)
    ray.get(engine.generate.remote("Hello", max_tokens=32, temperature=0.8))
    for chunk in engine.generate_stream.remote("Hello"): print(ray.get(chunk)["text"], end="")

Its keyword options are the fields of ``runtime.config.EngineConfig``. It builds the executor
actors for its plan (one GPU executor per GPU, one CPU executor), sets up their shared-memory
channel through Ray, and runs the request loop (``runtime.scheduler.Scheduler``) talking to the
GPU executor once per step, over a Unix socket the executor opens (``runtime.steplink``;
$POWERINFER_RAY_STEP_LINK=0: Ray calls). When an executor dies, in-flight requests fail with a
clear error, the executors are rebuilt and the next request is served. When the engine itself
dies, Ray restarts it (``max_restarts=-1``) under the same name and handle.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, AsyncIterator

import ray
from ray.util import metrics

from ..model.source import PLANTED_PREFIX, open_model
from ..runtime.config import GIB, EngineConfig, engine_n_ctx, resolve_plan, resolve_policy, resolve_prefill_chunk
from ..runtime.engine import make_tokenizer
from ..runtime.scheduler import Request, Scheduler
from ..runtime.shmfiles import sweep_stale
from ..runtime.steplink import StepClient
from .executors import CPUExecutor, GPUExecutor

log = logging.getLogger(__name__)
DEFAULT_NAME = "powerinfer-engine"
STEP_LINK = os.environ.get("POWERINFER_RAY_STEP_LINK", "1") != "0"  # 0: steps as Ray calls (A/B runs)


def _primary_fills(model: Any, device: str) -> bool:  # noqa: ANN401
    """Whether the primary generates the CPU executor's rows (runtime.sharedshard): planted models
    on a GPU primary. POWERINFER_RAY_PRIMARY_FILL=0 never, =1 also on a CPU primary (tests)."""
    env = os.environ.get("POWERINFER_RAY_PRIMARY_FILL", "")
    planted = isinstance(model, str) and model.startswith(PLANTED_PREFIX)
    return planted and env != "0" and (device == "cuda" or env == "1")


# seconds: histogram buckets of time to first token / in the queue, and of time per output token
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


@ray.remote(max_restarts=-1)
class Coordinator:
    def __init__(self, model: str | None = None, *, name: str | None = None, **options: Any) -> None:
        logging.basicConfig(level=logging.INFO)
        if model is None:
            from ..model.default import default_model_path

            model = str(default_model_path())
        self.ec = EngineConfig.from_options(str(model), **options)
        # the executors are named after the engine: its own actor name unless given, so two
        # engines in one cluster never collide
        self.name = name or ray.get_runtime_context().get_actor_name() or DEFAULT_NAME
        src = open_model(self.ec.model)
        self.cfg = src.config
        self.model_name = self.cfg.name or str(model)
        self.n_ctx = engine_n_ctx(self.ec, self.cfg)
        self.policy = resolve_policy(self.ec, self.cfg)
        self._check_device()
        t0 = time.perf_counter()
        self.plan = resolve_plan(self.ec, src)
        self.plan_s = time.perf_counter() - t0
        self.tokenizer = make_tokenizer(src.fields)
        self.gpu = self.cpu = None
        self.restarts = 0
        self.device = self._device()
        self.prefill_chunk = resolve_prefill_chunk(self.ec, self.device)
        self._start_named_executors()
        self.core = Scheduler(self._step, self.tokenizer, n_ctx=self.n_ctx, max_batch=self.ec.max_batch,
                              prefill_chunk=self.prefill_chunk, max_waiting=self.ec.max_waiting,
                              n_vocab=self.cfg.n_vocab, on_failure=self._recover, on_finish=self._observe)
        self._metrics()

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

    def _start_executors(self) -> None:
        ec, device = self.ec, self._device()
        t_max = max(self.prefill_chunk, ec.max_batch)
        common = dict(policy=self.policy, slots=ec.max_batch, n_ctx=self.n_ctx)
        budget = int(ec.vram_budget_gib * GIB) if ec.vram_budget_gib else None
        dev_name = "cuda0" if device == "cuda" else "cpu"
        threads = 0
        if self.plan.needs_cpu_executor:
            n_cpus = int(ray.cluster_resources().get("CPU", 2))
            threads = ec.threads or max(1, n_cpus - 2)  # default: all but the GPU executor's and one more
            if threads + 1 > n_cpus:  # the actor would wait forever for CPUs the cluster lacks
                raise ValueError(f"threads={threads}: the CPU executor reserves one CPU per thread and the GPU "
                                 f"executor one more, but the Ray cluster has {n_cpus} CPUs; use threads <= "
                                 f"{n_cpus - 1} (or start Ray with more CPUs)")
        self.gpu = self.cpu = self.spec = self.link = self.shard_spec = self.dense_prefill = None
        self.load_s: dict[str, float] = {}
        try:  # all or nothing: a half-built pair would hold the names a retry needs
            self.gpu = GPUExecutor.options(
                name=f"{self.name}.gpu-executor.{dev_name}", num_gpus=1 if device == "cuda" else 0, num_cpus=1,
            ).remote(f"{self.name}.gpu-executor.{dev_name}", ec.model, self.plan, budget_bytes=budget,
                     device=device, threshold=ec.threshold, t_max=t_max, dtype=ec.dtype, timeout_s=ec.timeout_s,
                     prefill_dense_min=ec.prefill_dense_min, graphs=ec.graphs, **common)
            if self.plan.needs_cpu_executor:
                self.cpu = CPUExecutor.options(name=f"{self.name}.cpu-executor.0", num_cpus=threads).remote(
                    f"{self.name}.cpu-executor.0", ec.model, self.plan, threads=threads,
                    defer_fill=_primary_fills(ec.model, device), **common)
            info = ray.get([self.gpu.ready.remote()] + ([self.cpu.ready.remote()] if self.cpu else []))
            log.info("executors ready: %s", info)
            # seconds each executor took to build its shard (they load in parallel), then the
            # primary's mapping of the CPU shard (below)
            self.load_s = dict(zip(("gpu", "cpu"), (round(i["load_s"], 1) for i in info)))
            if self.cpu is not None:
                self.shard_spec = ray.get(self.cpu.shard_spec.remote())
                if info[1]["needs_fill"]:  # a planted model's rows, made by the primary
                    t_f = time.perf_counter()
                    try:
                        ray.get(self.gpu.fill_cold.remote(self.shard_spec))
                        by_primary = True
                    except ray.exceptions.RayTaskError as e:  # e.g. cannot open the file: the old path
                        log.warning("the primary could not write the CPU executor's rows (%s); it loads them", e)
                        by_primary = False
                    ray.get(self.cpu.filled.remote(by_primary))
                    self.load_s["fill_cold" if by_primary else "cpu_fill"] = round(time.perf_counter() - t_f, 1)
            self.spec = ray.get(self.gpu.create_channel.remote())
            if self.cpu is not None:
                ray.get(self.cpu.attach.remote(self.spec))
                # dense prefill of long prompts reads the CPU executor's rows: its shared pages, or a copy
                t_a = time.perf_counter()
                self.dense_prefill = ray.get(self.gpu.attach_cold.remote(self.shard_spec))
                self.load_s["attach_cold"] = round(time.perf_counter() - t_a, 1)
            if STEP_LINK:  # steps over a Unix socket: Ray's ~1.5 ms per call off every token
                self.link = StepClient(ray.get(self.gpu.open_step_link.remote()))
        except BaseException:
            self._kill_executors()
            raise

    def _kill_executors(self) -> None:
        for a in (self.gpu, self.cpu):
            if a is not None:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001  (already dead)
                    pass
        self.gpu = self.cpu = None
        if getattr(self, "spec", None) is not None:
            self.spec.path.unlink(missing_ok=True)  # the dead primary cannot remove its channel
        link = getattr(self, "link", None)
        if link is not None:
            link.close()  # (its socket has no file: runtime/steplink.py)
            self.link = None

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

    async def _step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int]):  # noqa: ANN202
        if self.link is not None:
            out = await self.link.call(slots, tokens, start_pos)
        else:
            out = await self.gpu.step.remote(slots, tokens, start_pos)
        self.m_tokens.inc(len(tokens), tags={"engine": self.name})
        return out

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
        return {"model": self.model_name, "n_ctx": self.n_ctx, "policy": self.policy, "device": self.device,
                "executors": ["gpu"] + (["cpu"] if self.cpu else []), "plan_s": self.plan_s,
                "load_s": self.load_s, "dense_prefill": self.dense_prefill, "pid": os.getpid()}

    def model_info(self) -> dict[str, Any]:
        return {"name": self.model_name, "n_ctx": self.n_ctx, "n_vocab": self.cfg.n_vocab,
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
        out: dict[str, Any] = {"coordinator": self.core.stats(), "restarts": self.restarts,
                               "policy": self.policy, "n_ctx": self.n_ctx, "device": self.device}
        peer = None
        if self.cpu is not None:
            out["cpu_executor"] = await self.cpu.stats.remote()
            peer = out["cpu_executor"]["neurons"]
        out["gpu_executor"] = await self.gpu.stats.remote(peer)
        self.m_requests.set(out["coordinator"]["running"], tags={"engine": self.name})
        return out

    async def set_cpu_threads(self, n: int) -> int:
        """Threads of the CPU executor's kernels from the next layer on (no reload): for tuning
        and thread sweeps. The actor keeps the CPUs it reserved at start."""
        if self.cpu is None:
            raise ValueError("this engine's plan has no CPU executor")
        return await self.cpu.set_threads.remote(n)

    def executor_handles(self) -> dict[str, Any]:
        """The executor actors (for operations and fault tests)."""
        return {"gpu": self.gpu, "cpu": self.cpu}

    def shutdown(self) -> None:
        self._kill_executors()
