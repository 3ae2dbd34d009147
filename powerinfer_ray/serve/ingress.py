"""The FastAPI ingress: OpenAI's HTTP API over the engine actor, or over several engine replicas.

A plain class (``OpenAIServer``) holding the engines (``router.Router``: one, or replicas from
``actors.replicas``); ``serve.ingress(app)`` turns it into the Serve ingress (``OpenAIIngress``),
``serve.app`` into a deployment. Each route checks its request (``protocol``), sends it to the
replica with the fewest tokens in flight, calls the engine's ``generate`` / ``generate_stream``
once per choice (``n``), and answers in OpenAI's format (``responses``); errors have OpenAI's body
(``errors``). A request whose replica is lost before its first token has gone out (its actor or
node died) is sent to another replica; a stream cut later ends with an error event. A client that
goes away aborts its generations in the engine. Serve's proxy echoes the client's
``X-Request-Id`` header (or sends its own) on every response; ``X-Powerinfer-Engine`` names the
engine replica that served it.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.actor import ActorHandle

from .chat_template import ChatTemplate
from .config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_ENGINE, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IN_FLIGHT
from .errors import APIError, bad_request, engine_error, overloaded
from .protocol import (GenerationCall, check_model, json_body, parse_choices, parse_flag, parse_messages,
                       parse_prompt, parse_sampling, parse_stream, parse_token_ids, text)
from .responses import ResponseFormat, sse
from .router import Lease, ReplicaGauges, ReplicaState, Router

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 10.0
ENGINE_HEADER = "X-Powerinfer-Engine"  # names the engine replica that served a response

app = FastAPI(title="powerinfer-ray", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def _api_error_handler(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def resolve_engine(engine: str | ActorHandle, engine_options: dict[str, Any] | None = None,
                   namespace: str | None = None) -> ActorHandle:
    """The engine actor: a handle as given, the named actor, or (with engine_options) one created now."""
    if not isinstance(engine, str):
        return engine
    if engine_options is None:
        return ray.get_actor(engine, namespace=namespace)
    from ..actors.coordinator import Coordinator

    handle = Coordinator.options(name=engine, namespace=namespace, get_if_exists=True,
                                 max_concurrency=1000).remote(name=engine, **engine_options)
    ray.get(handle.ready.remote())
    return handle


def resolve_replicas(engine: str | ActorHandle | Sequence[Any], engine_options: dict[str, Any] | None = None,
                     namespace: str | None = None, replicas: dict[str, Any] | None = None) -> list[ReplicaState]:
    """The engines to route to: replicas as given (``actors.replicas.Replica``), replicas started
    now (``replicas`` with more than one, and engine_options), or the single engine."""
    if isinstance(engine, (list, tuple)):
        return [ReplicaState(r.name, r.engine, r.placement) for r in engine]
    if replicas and replicas.get("replicas", 1) > 1:
        if engine_options is None or not isinstance(engine, str):
            raise ValueError("replicas > 1: give the engine's name and its options (engine_options), or the "
                             "replicas from actors.replicas.start_replicas")
        from ..actors.replicas import start_replicas
        from ..runtime.config import EngineConfig

        opts = dict(engine_options)
        ec = EngineConfig.from_options(str(opts.pop("model")), **opts)
        started = start_replicas(ec, replicas["replicas"], replicas.get("replica_gpus", 1.0),
                                 replicas.get("replica_resource"), name=engine, namespace=namespace)
        return [ReplicaState(r.name, r.engine, r.placement) for r in started]
    handle = resolve_engine(engine, engine_options, namespace)
    return [ReplicaState(engine if isinstance(engine, str) else "", handle)]


def first_model_info(replicas: list[ReplicaState]) -> dict[str, Any]:
    """``model_info()`` of the first replica that answers (others may still wait for a node); the
    last failure when none can start."""
    pending = {r.engine.model_info.remote(): r for r in replicas}
    error: BaseException | None = None
    while pending:
        (done,), _ = ray.wait(list(pending), num_returns=1)
        r = pending.pop(done)
        try:
            info = ray.get(done)
        except ray.exceptions.RayError as exc:
            error = exc
            continue
        r.name, r.state = r.name or info["engine"], "up"
        return info
    assert error is not None
    raise error


class OpenAIServer:
    """OpenAI's HTTP API over the engine replicas (a plain class: ``serve.app`` makes it a deployment)."""

    def __init__(self, engine: str | ActorHandle | Sequence[Any] = DEFAULT_ENGINE, model_name: str | None = None,
                 *, api_key: str | None = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 engine_options: dict[str, Any] | None = None, namespace: str | None = None,
                 replicas: dict[str, Any] | None = None) -> None:
        states = resolve_replicas(engine, engine_options, namespace, replicas)
        self.owned = [s for s in states if s.placement is not None] if replicas else []  # stopped with the app
        info = first_model_info(states)
        self.router = Router(states)
        self.gauges = ReplicaGauges()
        self.monitor: asyncio.Task | None = None
        self.model_name = model_name or info["name"]
        self.n_ctx, self.n_vocab = int(info["n_ctx"]), int(info["n_vocab"])
        self.template = ChatTemplate(info.get("chat_template"), info.get("bos_token") or "",
                                     info.get("eos_token") or "", bool(info.get("add_bos", True)))
        self.api_key = api_key or None
        self.max_in_flight, self.in_flight = max_in_flight, 0
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.created = int(time.time())

    def __del__(self) -> None:
        """Serve calls this when the app goes away: the replicas this ingress started go with it."""
        if getattr(self, "owned", None):
            from ..actors.replicas import Replica, stop_replicas

            stop_replicas([Replica(s.name, s.engine, s.placement) for s in self.owned])

    # --- routes ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while a replica answers (each replica's state, node, device and load in the body), else 503."""
        self._watch()
        await self.router.probe(HEALTH_TIMEOUT_S)
        self.gauges.update(self.router.replicas)
        up = self.router.up()
        if not up:
            why = "; ".join(f"{r.name}: {r.state} ({r.error})" for r in self.router.replicas)
            return APIError(503, f"the engine does not answer: {why}", type_="server_error",
                            code="engine_unavailable").response()
        status = "ok" if len(up) == len(self.router.replicas) else "degraded"
        return JSONResponse({"status": status, "model": self.model_name, "in_flight": self.in_flight,
                             "replicas": [r.report() for r in self.router.replicas]})

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "powerinfer-ray", "max_model_len": self.n_ctx}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:  # noqa: ANN401
        body = await self._checked(request)
        prompt, ids = parse_prompt(body.get("prompt"), self.n_vocab)
        sampling = parse_sampling(body, default_max_tokens=16)
        echo = parse_flag(body, "echo")
        if echo and sampling["logprobs"] is not None:
            sampling["prompt_logprobs"] = sampling["logprobs"]
        call = GenerationCall(prompt, ids, sampling, parse_choices(body), *parse_stream(body), echo=echo)
        fmt = self._format(False, body, logprobs=sampling["logprobs"] is not None)
        if echo:
            fmt.echo = prompt if prompt is not None else (await self._engine_call("decode", ids))[0]
        return await self._serve(call, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:  # noqa: ANN401
        body = await self._checked(request)
        if body.get("echo") not in (None, False):
            raise bad_request("echo is not supported by chat completions (the completions API has it)", "echo",
                              "unsupported_parameter")
        prompt = self.template.render(parse_messages(body.get("messages")))
        sampling = parse_sampling(body, default_max_tokens=None, chat=True)  # None: until the context is full
        call = GenerationCall(prompt, None, sampling, parse_choices(body), *parse_stream(body))
        return await self._serve(call, self._format(True, body, logprobs=sampling["logprobs"] is not None))

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: {"prompt"} or {"messages"} (rendered with the chat template) -> token ids."""
        body = await self._checked(request, model_required=False)
        if body.get("messages") is not None:
            prompt = self.template.render(parse_messages(body["messages"]))
        elif isinstance(body.get("prompt"), str):
            prompt = text(body["prompt"], "prompt")
        else:
            raise bad_request("send 'prompt' (a string) or 'messages'", "prompt", "missing_field")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise bad_request(f"add_special_tokens is {special!r}, expected a boolean", "add_special_tokens")
        ids, replica = await self._engine_call("encode", prompt, special)
        return JSONResponse({"count": len(ids), "max_model_len": self.n_ctx, "tokens": ids},
                            headers={ENGINE_HEADER: replica})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body = await self._checked(request, model_required=False)
        ids = parse_token_ids(body, "tokens", self.n_vocab)
        prompt, replica = await self._engine_call("decode", ids)
        return JSONResponse({"prompt": prompt}, headers={ENGINE_HEADER: replica})

    async def _checked(self, request: Request, model_required: bool = True) -> dict[str, Any]:
        """The request's JSON body, after its API key; its ``model`` must be the served one."""
        self._watch()
        self._authorize(request)
        body = await json_body(request, self.max_body_bytes, self.body_timeout_s)
        if model_required or body.get("model") is not None:
            check_model(body, self.model_name)
        return body

    def _format(self, chat: bool, body: dict[str, Any], logprobs: bool) -> ResponseFormat:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return ResponseFormat(chat, rid, self.model_name, token_ids=parse_flag(body, "return_token_ids"),
                              logprobs=logprobs)

    # --- replicas --------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Start the replicas' probes (in the replica's event loop, on its first request)."""
        if self.monitor is None or self.monitor.done():
            self.monitor = asyncio.ensure_future(self.router.run(lambda: self.gauges.update(self.router.replicas)))

    def _pick(self, tried: set[str], error: APIError | None = None) -> ReplicaState:
        """The replica for a request's next attempt; the last attempt's error when every replica was tried."""
        replica = self.router.pick(tried)
        if replica is None:
            assert error is not None
            raise error
        tried.add(replica.name)
        return replica

    def _failed(self, replica: ReplicaState, exc: BaseException) -> APIError:
        """The HTTP error of a failed engine call, naming the replica; a lost replica is marked down."""
        err = engine_error(exc, f"engine {replica.name}")
        err.headers[ENGINE_HEADER] = replica.name
        if err.code == "engine_unavailable":
            self.router.lost(replica, err.message)
        return err

    def _retry(self, err: APIError, tried: set[str]) -> bool:
        """Whether a failed attempt goes to another replica: its replica was lost, and another is left."""
        return err.code == "engine_unavailable" and any(r.name not in tried for r in self.router.up())

    async def _engine_call(self, method: str, *args: Any) -> tuple[Any, str]:  # noqa: ANN401
        """A short engine call (encode, decode) on a replica: its answer and the replica's name."""
        tried: set[str] = set()
        err = None
        while True:
            replica = self._pick(tried, err)
            try:
                return await getattr(replica.engine, method).remote(*args), replica.name
            except Exception as exc:  # noqa: BLE001  (mapped to its HTTP error)
                err = self._failed(replica, exc)
                if not self._retry(err, tried):
                    raise err from exc

    # --- generation --------------------------------------------------------------------------------
    async def _serve(self, call: GenerationCall, fmt: ResponseFormat) -> Any:  # noqa: ANN401
        if self.in_flight + call.n > self.max_in_flight:
            raise overloaded(f"{self.in_flight} generations in flight (limit {self.max_in_flight}); retry later")
        self.in_flight += call.n
        if call.stream:  # from here the stream owns the slots and releases them
            served: dict[str, str] = {}
            events = self._events(call, fmt, served)
            first = await events.__anext__()  # errors before the first token are HTTP errors
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", ENGINE_HEADER: served["by"]})
        try:
            outs, replica = await self._generate(call, fmt.id)
        finally:
            self.in_flight -= call.n
        return JSONResponse(fmt.response(outs), headers={ENGINE_HEADER: replica})

    async def _generate(self, call: GenerationCall, rid: str) -> tuple[list[dict[str, Any]], str]:
        """The ``n`` results of one request and the replica that made them; a failure or a
        cancellation aborts them all; a lost replica's request goes to another."""
        ids = [f"{rid}-{i}" for i in range(call.n)]
        tried: set[str] = set()
        err = None
        while True:
            replica = self._pick(tried, err)
            lease = self.router.lease(replica, call.tokens(self.n_ctx))
            refs = [replica.engine.generate.remote(call.prompt, request_id=ids[i], **call.engine_kwargs(i))
                    for i in range(call.n)]
            try:
                outs = list(await asyncio.gather(*refs))
            except BaseException as exc:
                for i in ids:
                    replica.engine.abort.remote(i)
                if isinstance(exc, asyncio.CancelledError):  # the client went away
                    raise
                err = self._failed(replica, exc)
                if self._retry(err, tried):
                    continue
                raise err from exc
            finally:
                lease.release()
            replica.served += 1
            self.router.count(replica, sum(o["stats"]["completion_tokens"] for o in outs))
            return outs, replica.name

    async def _open(self, call: GenerationCall, ids: list[str]) -> tuple[Lease, list[asyncio.Future],
                                                                          asyncio.Queue, tuple[int, Any]]:
        """Start the ``n`` streams on a replica and wait for the first chunk; a replica lost before
        it (nothing has gone out yet) is left for another. Returns the replica's lease, the pumps,
        their queue and the first item."""
        tried: set[str] = set()
        err = None
        while True:
            replica = self._pick(tried, err)
            lease = self.router.lease(replica, call.tokens(self.n_ctx))
            queue: asyncio.Queue = asyncio.Queue()
            pumps = [asyncio.ensure_future(_pump(i, replica.engine.generate_stream.remote(
                call.prompt, request_id=ids[i], **call.engine_kwargs(i)), queue)) for i in range(call.n)]
            try:
                first = await queue.get()
            except BaseException:  # the client went away
                _stop(replica, pumps, ids)
                lease.release()
                raise
            if not isinstance(first[1], BaseException):
                return lease, pumps, queue, first
            _stop(replica, pumps, ids)
            lease.release()
            err = self._failed(replica, first[1])
            if not self._retry(err, tried):
                raise err

    async def _events(self, call: GenerationCall, fmt: ResponseFormat, served: dict[str, str]) -> AsyncIterator[bytes]:
        """SSE bytes of the ``n`` streamed choices of one request, interleaved as they come; every
        choice not finished when the stream ends (the client left, an error) is aborted.
        served["by"]: the replica's name, once the first chunk is in."""
        ids = [f"{fmt.id}-{i}" for i in range(call.n)]
        finished: dict[int, dict] = {}
        lease, pumps = None, []
        try:
            lease, pumps, queue, (i, chunk) = await self._open(call, ids)  # before the first byte: HTTP errors
            replica = lease.replica
            served["by"] = replica.name
            if fmt.chat:
                for j in range(call.n):
                    yield sse(fmt.chunk(j, "", role=True))
            open_ = call.n
            while True:
                if chunk is None:
                    open_ -= 1
                elif isinstance(chunk, BaseException):  # mid-stream: the status is sent already, report in-band
                    yield sse(self._failed(replica, chunk).body())
                    break
                else:
                    self.router.count(replica, len(chunk.get("token_ids") or ()))
                    if chunk.get("finish_reason"):
                        finished[i] = chunk.get("stats") or {}
                    events = fmt.events(i, chunk)
                    if events and len(finished) == call.n and chunk.get("finish_reason") and not call.include_usage:
                        events[-1]["usage"] = _usage(finished)  # the last chunk carries the usage
                    for event in events:
                        yield sse(event)
                if open_ == 0:
                    break
                i, chunk = await queue.get()
            if call.include_usage and len(finished) == call.n:
                yield sse(fmt.usage_chunk(**_usage(finished, total=False)))
            if len(finished) == call.n:
                replica.served += 1
            yield sse("[DONE]")
        finally:
            for p in pumps:
                p.cancel()
            if lease is not None:
                lease.release()
                for j, rid in enumerate(ids):
                    if j not in finished:
                        lease.replica.engine.abort.remote(rid)
            self.in_flight -= call.n

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# The routes become methods at import, in every process that imports this module: the deployment
# pickles ``app`` by reference, so a replica sees the module's (transformed) app.
OpenAIIngress = serve.ingress(app)(OpenAIServer)


def _usage(finished: dict[int, dict], total: bool = True) -> dict[str, int]:
    prompt = next(iter(finished.values()), {}).get("prompt_tokens", 0)
    completion = sum(s.get("completion_tokens", 0) for s in finished.values())
    if not total:
        return {"prompt_tokens": prompt, "completion_tokens": completion}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _pump(i: int, gen: Any, queue: asyncio.Queue) -> None:  # noqa: ANN401
    """Choice ``i``'s engine chunks into ``queue`` as (i, chunk), then (i, None); an engine failure
    as (i, the exception)."""
    try:
        while True:
            try:
                chunk = await (await gen.__anext__())
            except StopAsyncIteration:
                break
            queue.put_nowait((i, chunk))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001  (the ingress maps it to its HTTP error)
        queue.put_nowait((i, exc))
        return
    queue.put_nowait((i, None))


def _stop(replica: ReplicaState, pumps: list[asyncio.Future], ids: list[str]) -> None:
    """Stop reading the streams ``ids`` and abort them in the engine."""
    for p in pumps:
        p.cancel()
    for rid in ids:
        replica.engine.abort.remote(rid)


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item
