"""The FastAPI ingress: OpenAI's HTTP API over the engine actor.

A plain class (``OpenAIServer``) holding a handle to the engine; ``serve.ingress(app)`` turns it
into the Serve ingress (``OpenAIIngress``), ``serve.app`` into a deployment. Each route checks
its request (``protocol``), calls the engine's ``generate`` / ``generate_stream`` once per choice
(``n``), and answers in OpenAI's format (``responses``); errors have OpenAI's body (``errors``).
A client that goes away aborts its generations in the engine. Serve's proxy echoes the client's
``X-Request-Id`` header (or sends its own) on every response.
"""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any, AsyncIterator

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

HEALTH_TIMEOUT_S = 10.0

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


class OpenAIServer:
    """OpenAI's HTTP API over the engine actor (a plain class: ``serve.app`` makes it a deployment)."""

    def __init__(self, engine: str | ActorHandle = DEFAULT_ENGINE, model_name: str | None = None, *,
                 api_key: str | None = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 engine_options: dict[str, Any] | None = None, namespace: str | None = None) -> None:
        self.engine = resolve_engine(engine, engine_options, namespace)
        info = ray.get(self.engine.model_info.remote())
        self.model_name = model_name or info["name"]
        self.n_ctx, self.n_vocab = int(info["n_ctx"]), int(info["n_vocab"])
        self.template = ChatTemplate(info.get("chat_template"), info.get("bos_token") or "",
                                     info.get("eos_token") or "", bool(info.get("add_bos", True)))
        self.api_key = api_key or None
        self.max_in_flight, self.in_flight = max_in_flight, 0
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.created = int(time.time())

    # --- routes ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await asyncio.wait_for(asyncio.ensure_future(self.engine.ready.remote()), timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (any failure: the engine does not answer)
            return APIError(503, f"the engine does not answer: {type(exc).__name__}", type_="server_error",
                            code="engine_unavailable").response()
        return JSONResponse({"status": "ok", "model": self.model_name, "in_flight": self.in_flight})

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
            fmt.echo = prompt if prompt is not None else await self._engine_call(self.engine.decode, ids)
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
    async def tokenize(self, request: Request) -> dict[str, Any]:
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
        ids = await self._engine_call(self.engine.encode, prompt, special)
        return {"count": len(ids), "max_model_len": self.n_ctx, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body = await self._checked(request, model_required=False)
        ids = parse_token_ids(body, "tokens", self.n_vocab)
        return {"prompt": await self._engine_call(self.engine.decode, ids)}

    async def _checked(self, request: Request, model_required: bool = True) -> dict[str, Any]:
        """The request's JSON body, after its API key; its ``model`` must be the served one."""
        self._authorize(request)
        body = await json_body(request, self.max_body_bytes, self.body_timeout_s)
        if model_required or body.get("model") is not None:
            check_model(body, self.model_name)
        return body

    def _format(self, chat: bool, body: dict[str, Any], logprobs: bool) -> ResponseFormat:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return ResponseFormat(chat, rid, self.model_name, token_ids=parse_flag(body, "return_token_ids"),
                              logprobs=logprobs)

    # --- generation --------------------------------------------------------------------------------
    async def _serve(self, call: GenerationCall, fmt: ResponseFormat) -> Any:  # noqa: ANN401
        if self.in_flight + call.n > self.max_in_flight:
            raise overloaded(f"{self.in_flight} generations in flight (limit {self.max_in_flight}); retry later")
        self.in_flight += call.n
        if call.stream:  # from here the stream owns the slots and releases them
            events = self._events(call, fmt)
            first = await events.__anext__()  # errors before the first token are HTTP errors
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            outs = await self._generate(call, fmt.id)
        finally:
            self.in_flight -= call.n
        return JSONResponse(fmt.response(outs))

    async def _generate(self, call: GenerationCall, rid: str) -> list[dict[str, Any]]:
        """The ``n`` results of one request; a failure or a cancellation aborts them all."""
        ids = [f"{rid}-{i}" for i in range(call.n)]
        refs = [self.engine.generate.remote(call.prompt, request_id=ids[i], **call.engine_kwargs(i))
                for i in range(call.n)]
        try:
            return list(await asyncio.gather(*refs))
        except BaseException as exc:
            for i in ids:
                self.engine.abort.remote(i)
            if isinstance(exc, asyncio.CancelledError):  # the client went away
                raise
            raise engine_error(exc) from exc

    async def _events(self, call: GenerationCall, fmt: ResponseFormat) -> AsyncIterator[bytes]:
        """SSE bytes of the ``n`` streamed choices of one request, interleaved as they come; every
        choice not finished when the stream ends (the client left, an error) is aborted."""
        ids = [f"{fmt.id}-{i}" for i in range(call.n)]
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, self.engine.generate_stream.remote(
            call.prompt, request_id=ids[i], **call.engine_kwargs(i)), queue)) for i in range(call.n)]
        finished: dict[int, dict] = {}
        try:
            i, chunk = await queue.get()
            if isinstance(chunk, APIError):  # before the first byte: an HTTP error
                raise chunk
            if fmt.chat:
                for j in range(call.n):
                    yield sse(fmt.chunk(j, "", role=True))
            open_ = call.n
            while True:
                if chunk is None:
                    open_ -= 1
                elif isinstance(chunk, APIError):  # mid-stream: the status is sent already, report in-band
                    yield sse(chunk.body())
                    break
                else:
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
            yield sse("[DONE]")
        finally:
            for p in pumps:
                p.cancel()
            for j, rid in enumerate(ids):
                if j not in finished:
                    self.engine.abort.remote(rid)
            self.in_flight -= call.n

    async def _engine_call(self, method: Any, *args: Any) -> Any:  # noqa: ANN401
        try:
            return await method.remote(*args)
        except Exception as exc:  # noqa: BLE001  (mapped to its HTTP error)
            raise engine_error(exc) from exc

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
    """Choice ``i``'s engine chunks into ``queue`` as (i, chunk), then (i, None); an engine error
    as (i, APIError)."""
    try:
        while True:
            try:
                chunk = await (await gen.__anext__())
            except StopAsyncIteration:
                break
            queue.put_nowait((i, chunk))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001  (mapped to its HTTP error)
        queue.put_nowait((i, engine_error(exc)))
        return
    queue.put_nowait((i, None))


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item
