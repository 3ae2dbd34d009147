"""The scheduler: the request loop of the engine, as a plain asyncio class.

It owns the request queue, continuous batching (a prefill chunk of the prompts that can share a
step, then one decode step of every running request, in turn), sampling, stop conditions,
log-probabilities, streaming and per-request statistics; prompts are checked and tokenized off
its event loop (``runtime.prompt``). It talks to the primary executor once per step through
``step_fn`` (the step link in the actor, a direct call in tests); while no running request
prefills, penalizes or asks for log-probabilities, once per burst of up to ``decode_burst`` decode
steps that the primary runs back to back, sampling each next token itself (``_burst``). Executors do the
per-layer work.

``step()`` reads like its docstring: schedule, execute, make output.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
import torch

from ..model.tokenizer import IncrementalText, Tokenizer
from .prompt import PromptChecker
from .sampling import Burst, SamplingParams, logprobs_of, make_generator, sample

log = logging.getLogger(__name__)

# (slots, tokens, start_pos) -> logits [B, V]; with a fourth argument, a Burst: its decode steps back
# to back -> (the tokens chosen [n, B], the samplers' generator states after them)
StepFn = Callable[..., Awaitable[np.ndarray]]


class EngineError(RuntimeError):
    """A request failed inside the engine (for example an executor died mid-generation)."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429/503)."""


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    gen: torch.Generator
    max_new: int  # tokens it may generate: max_tokens, or what the context leaves
    slot: int = -1
    pos: int = 0  # tokens already in the KV cache
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # per output token, when params.logprobs is set
    prompt_logprobs: list[dict] = field(default_factory=list)  # per prompt token (the first's logprob: None)
    prompt_logprobs_sent: bool = False  # streamed with the first event
    counts: torch.Tensor | None = None  # [V] times each token was generated (penalties)
    text: str = ""
    detok: IncrementalText | None = None  # text from output_ids, a few ids a step
    emitted: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    error: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float | None = None
    t_first: float | None = None
    t_end: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def timings(self) -> dict[str, float | None]:
        """Seconds in the queue, to the first token, per output token after it (TPOT), in all."""
        n, end = len(self.output_ids), self.t_end or time.perf_counter()
        decode_s = end - self.t_first if self.t_first and n > 1 else 0.0
        return {"queue_s": (self.t_admit - self.t_submit) if self.t_admit else None,
                "ttft_s": (self.t_first - self.t_submit) if self.t_first else None,
                "tpot_s": decode_s / (n - 1) if decode_s > 0 else None, "total_s": end - self.t_submit}

    def result(self) -> dict[str, Any]:
        n, t = len(self.output_ids), self.timings()
        out = {"id": self.id, "text": self.text, "token_ids": list(self.output_ids),
               "prompt_token_ids": list(self.prompt_ids), "finish_reason": self.finish_reason,
               "stats": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n, **t,
                         "decode_tok_s": 1.0 / t["tpot_s"] if t["tpot_s"] else None}}
        if self.params.logprobs is not None:
            out["logprobs"] = list(self.logprobs)
        if self.params.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(self.prompt_logprobs)
        return out


class Scheduler:
    """Request loop over one primary executor (see the module docstring). ``on_finish(request)``
    is called once per request that ends (metrics)."""

    def __init__(self, step_fn: StepFn, tokenizer: Tokenizer | None, *, n_ctx: int, max_batch: int = 8,
                 prefill_chunk: int = 128, max_waiting: int = 256, eos_id: int | None = None,
                 n_vocab: int | None = None, on_failure: Callable[[BaseException], Awaitable[None]] | None = None,
                 on_finish: Callable[[Request], None] | None = None, decode_burst: int = 1) -> None:
        assert max_batch >= 1 and prefill_chunk >= 1 and n_ctx >= 2, (max_batch, prefill_chunk, n_ctx)
        self.step_fn, self.tok, self.on_failure, self.on_finish = step_fn, tokenizer, on_failure, on_finish
        self.n_ctx, self.max_batch, self.prefill_chunk, self.max_waiting = n_ctx, max_batch, prefill_chunk, max_waiting
        self.decode_burst = decode_burst
        self.prompts = PromptChecker(tokenizer, n_ctx, n_vocab)
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eos_id if tokenizer else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.free_slots = list(range(max_batch))
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "aborted": 0, "tokens": 0,
                         "prompt_tokens": 0, "steps": 0, "step_s": 0.0, "decode_steps": 0, "decode_s": 0.0,
                         "decode_tokens": 0, "prefill_s": 0.0}

    # --- public --------------------------------------------------------------------------------
    async def submit(self, prompt: str | list[int] | None = None, *, prompt_token_ids: list[int] | None = None,
                     request_id: str | None = None, **sampling: Any) -> Request:
        """Validate and queue a request (raises ValueError on bad input, EngineOverloaded when full)."""
        params = SamplingParams.from_kwargs(**sampling)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id is {request_id!r}, expected a non-empty string")
        self._check_room()
        ids = await self.prompts.ids(prompt, prompt_token_ids)
        max_new = self.prompts.check_budget(len(ids), params.max_tokens)
        self._check_room()  # again: others may have queued while this prompt was tokenized
        req = Request(request_id or f"req-{next(self._ids)}", ids, params, make_generator(params.seed), max_new)
        if req.id in self.requests:
            raise ValueError(f"request id {req.id!r} is already in use")
        self.requests[req.id] = req
        self.waiting.append(req)
        self.counters["requests"] += 1
        self._ensure_loop()
        self._wake.set()
        return req

    async def generate(self, prompt: str | list[int] | None = None, **kw: Any) -> dict[str, Any]:
        req = await self.submit(prompt, **kw)
        try:
            async for _ in self._events(req):
                pass
        finally:
            if not req.done:  # the caller was cancelled (e.g. an HTTP client went away): free the slot
                self.abort(req.id)
        return req.result()

    async def generate_stream(self, prompt: str | list[int] | None = None, **kw: Any) -> AsyncIterator[dict]:
        """Yields {"id", "text" (delta), "token_ids" (new), "finish_reason"} chunks, with "logprobs"
        of the new tokens when asked; the first carries "prompt_logprobs" when asked, the last "stats"."""
        req = await self.submit(prompt, **kw)
        try:
            async for ev in self._events(req):
                yield ev
        finally:
            if not req.done:  # the consumer went away: cancel and free the slot
                self.abort(req.id)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.done:
            return False
        self._finish(req, "abort")
        self.counters["aborted"] += 1
        return True

    def stats(self) -> dict[str, Any]:
        c = dict(self.counters)
        c["running"], c["waiting"] = len(self.running), len(self.waiting)
        c["decode_tok_s"] = c["decode_tokens"] / c["decode_s"] if c["decode_s"] else 0.0
        return c

    # --- helpers -------------------------------------------------------------------------------
    def _check_room(self) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise EngineOverloaded(f"{len(self.waiting)} requests are waiting (limit {self.max_waiting}); retry later")

    async def _events(self, req: Request) -> AsyncIterator[dict]:
        while True:
            ev = await req.events.get()
            if "error" in ev:
                raise EngineError(ev["error"])
            yield ev
            if ev.get("finish_reason"):
                return

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            # the loop runs in a fresh context, not in that of the request that happened to start
            # it: Ray tracks a task's children through contextvars, and cancelling that request
            # (ray.cancel, Serve on a client disconnect) would otherwise cancel every later step
            loop = asyncio.get_running_loop()
            self._task = contextvars.Context().run(loop.create_task, self._loop())

    async def _loop(self) -> None:
        while True:
            if not (self.waiting or self.running):
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.step()
            except Exception as exc:  # an executor failed: fail what was in flight, recover
                log.exception("step failed")
                await self._fail_running(exc)

    async def _fail_running(self, exc: BaseException) -> None:
        msg = f"generation failed: {type(exc).__name__}: {exc}"
        for req in list(self.running):
            req.error = msg
            self._finish(req, "error")
            self.counters["failed"] += 1
        if self.on_failure is not None:
            try:
                await self.on_failure(exc)
            except Exception:  # noqa: BLE001
                log.exception("recovery after executor failure failed")

    # --- the step ---------------------------------------------------------------------------------
    async def step(self) -> None:
        """Schedule (admit waiting requests into free slots), execute one prefill chunk and one
        decode step of the running requests, make output (sample, detokenize, stop, stream)."""
        self._admit()
        group, size = self._prefill_group()
        if group:
            await self._prefill(group, size)
        dec = [r for r in self.running if not r.prefilling and not r.done][: self.max_batch]
        if dec:
            burst = self._burst(dec)
            t0 = time.perf_counter()
            out = await self._execute(dec, [[r.output_ids[-1]] for r in dec], burst)
            self.counters["decode_s"] += time.perf_counter() - t0
            self.counters["decode_steps"] += burst.n if burst else 1
            if burst:  # the tokens the primary chose, [n, B]: those after a request's end are dropped
                out, states = out
                for r, state in zip(dec, states):
                    if state is not None:
                        r.gen.set_state(state)
                for row in out:
                    for r, tok in zip(dec, row):
                        if not r.done:
                            r.pos += 1
                            self.counters["decode_tokens"] += 1
                            self._accept(r, int(tok))
            else:
                self.counters["decode_tokens"] += len(dec)
                for r, lg in zip(dec, out):
                    r.pos += 1
                    if not r.done:
                        self._emit(r, lg)
        self.running = [r for r in self.running if not r.done]

    def _burst(self, dec: list[Request]) -> Burst | None:
        """The decode steps the primary runs back to back for ``dec`` (None: one step, its logits here):
        up to ``decode_burst`` while none of them penalizes or asks for log-probabilities (both need
        every step here) and no request prefills or waits for a free slot (it would wait for the
        burst's end), never past a request's last token. Requests that wait for a slot to free wait
        a burst at most. The primary samples with each request's generator, as ``_emit`` would."""
        if self.decode_burst <= 1 or (self.waiting and self.free_slots) or len(dec) < len(self.running):
            return None
        if any(r.params.penalized or r.params.logprobs is not None for r in dec):
            return None
        n = min(self.decode_burst, min(r.max_new - len(r.output_ids) for r in dec))
        if n <= 1:
            return None
        return Burst(n, [(r.params, None if r.params.temperature == 0.0 else r.gen.get_state()) for r in dec])

    def _prefill_group(self) -> tuple[list[Request], int]:
        """The prompts one prefill step runs, and the tokens each gives it. A step runs sequences
        of equal token counts, at most ``prefill_chunk`` tokens in all: of the first B prefilling
        requests (in arrival order), each gives min(the fewest tokens any of them has left,
        prefill_chunk // B); B is the count that runs the most tokens (the fewest requests on a
        tie). A request scoring its prompt tokens goes one token a step, alone."""
        pre = [r for r in self.running if r.prefilling]
        if not pre:
            return [], 0
        if pre[0].params.prompt_logprobs is not None:
            return pre[:1], 1
        best, left = (0, 0, 0), self.prefill_chunk  # (tokens, B, T)
        for b, r in enumerate(itertools.takewhile(lambda r: r.params.prompt_logprobs is None, pre), 1):
            left = min(left, len(r.prompt_ids) - r.pos)
            t = min(left, self.prefill_chunk // b)
            if t == 0:
                break
            if b * t > best[0]:
                best = (b * t, b, t)
        return pre[:best[1]], best[2]

    async def _prefill(self, group: list[Request], size: int) -> None:
        """One prompt chunk of ``size`` tokens of each request of ``group``; a request that asks
        for prompt log-probabilities comes alone with size 1 (the executor returns the last
        position's logits, which score the next prompt token)."""
        chunks = [r.prompt_ids[r.pos: r.pos + size] for r in group]
        t0 = time.perf_counter()
        logits = await self._execute(group, chunks)
        self.counters["prefill_s"] += time.perf_counter() - t0
        for req, chunk, lg in zip(group, chunks, logits):
            if req.params.prompt_logprobs is not None:
                if req.pos == 0:  # nothing scores the first token
                    first = req.prompt_ids[0]
                    req.prompt_logprobs.append({"token_id": first, "token": self._piece(first), "logprob": None,
                                                "top": []})
                if req.pos + 1 < len(req.prompt_ids):
                    req.prompt_logprobs.append(self._logprob_entry(lg, req.prompt_ids[req.pos + 1],
                                                                   req.params.prompt_logprobs))
            req.pos += len(chunk)
            self.counters["prompt_tokens"] += len(chunk)
            if not req.prefilling and not req.done:
                self._emit(req, lg)

    def _admit(self) -> None:
        self.running = [r for r in self.running if not r.done]
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.done:
                continue
            req.slot = self.free_slots.pop(0)
            req.t_admit = time.perf_counter()
            self.running.append(req)

    async def _execute(self, reqs: list[Request], tokens: list[list[int]],
                       burst: Burst | None = None) -> Any:  # noqa: ANN401
        t0 = time.perf_counter()
        args = ([r.slot for r in reqs], tokens, [r.pos for r in reqs]) + ((burst,) if burst else ())
        logits = await self.step_fn(*args)
        self.counters["steps"] += 1
        self.counters["step_s"] += time.perf_counter() - t0
        return logits

    def _emit(self, req: Request, logits: np.ndarray) -> None:
        self._accept(req, sample(logits, req.params, req.gen, req.counts), logits)

    def _accept(self, req: Request, tok: int, logits: np.ndarray | None = None) -> None:
        """The request's next token (sampled from ``logits``, or by the primary in a burst: then no
        penalties or log-probabilities, which need the logits): stop, stream."""
        p = req.params
        if req.t_first is None:
            req.t_first = time.perf_counter()
        req.output_ids.append(tok)
        if p.penalized:
            if req.counts is None:
                req.counts = torch.zeros(len(logits), dtype=torch.float32)
            req.counts[tok] += 1
        new_lp = [self._logprob_entry(logits, tok, p.logprobs)] if p.logprobs is not None else []
        self.counters["tokens"] += 1
        reason, new_ids = None, [tok]
        if (tok == self.eos_id and not p.ignore_eos) or tok in p.stop_token_ids:
            reason, new_ids, new_lp = "stop", [], []
            req.output_ids.pop()  # the stop token is not part of the output
        req.logprobs.extend(new_lp)
        last = reason is not None or len(req.output_ids) >= req.max_new
        self._detokenize(req, final=last)  # at the output's end decode()'s text, a trailing incomplete sequence too
        if reason is None and p.stop:
            cut = min((i for i in (req.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                req.text, reason = req.text[:cut], "stop"
        if reason is None and last:
            reason = "length"
        hold = 0 if reason else max((len(s) - 1 for s in p.stop), default=0)
        self._push(req, hold, new_ids, new_lp)
        if reason:
            self._finish(req, reason)

    def _logprob_entry(self, logits: np.ndarray, token: int, top: int) -> dict[str, Any]:
        """{"token_id", "token" (its text), "logprob", "top": [{"token_id", "token", "logprob"}]}."""
        lp, alts = logprobs_of(logits, token, top)
        return {"token_id": token, "token": self._piece(token), "logprob": lp,
                "top": [{"token_id": i, "token": self._piece(i), "logprob": v} for i, v in alts]}

    def _piece(self, token: int) -> str:
        return self.tok.decode([token], skip_special=False) if self.tok is not None else ""

    def _detokenize(self, req: Request, final: bool = False) -> None:
        if self.tok is None:
            return
        if req.detok is None:
            req.detok = IncrementalText(self.tok)
        req.text = req.detok.update(req.output_ids, final)  # unless final, an incomplete UTF-8 sequence waits

    def _push(self, req: Request, hold: int, new_ids: list[int], new_lp: list[dict]) -> None:
        upto = max(req.emitted, len(req.text) - hold)
        delta = req.text[req.emitted: upto]
        req.emitted = upto
        if delta or new_ids:
            req.events.put_nowait(self._event(req, text=delta, token_ids=new_ids, finish_reason=None, logprobs=new_lp))

    def _event(self, req: Request, **ev: Any) -> dict[str, Any]:
        """A stream event; the first one of a request that asked for them carries the prompt's
        log-probabilities, and "logprobs" is there (maybe empty) whenever they were asked for."""
        out = {"id": req.id, **ev}
        if req.params.logprobs is None:
            out.pop("logprobs", None)
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            out["prompt_logprobs"], req.prompt_logprobs_sent = list(req.prompt_logprobs), True
        return out

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason, req.t_end = reason, time.perf_counter()
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1
        if reason == "error":
            req.events.put_nowait({"id": req.id, "error": req.error})
        else:
            delta = req.text[req.emitted:]
            req.emitted = len(req.text)
            req.events.put_nowait(self._event(req, text=delta, token_ids=[], finish_reason=reason, logprobs=[],
                                              stats=req.result()["stats"]))
            self.counters["finished"] += reason != "abort"
        self.requests.pop(req.id, None)
        if self.on_finish is not None:
            self.on_finish(req)
        self._wake.set()
