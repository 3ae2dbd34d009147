"""The OpenAI-compatible Ray Serve app: our own FastAPI ingress over the engine actor.

``ray.serve.llm`` needs vLLM, so the front end is a plain class (``OpenAIServer``) turned into
a deployment with ``serve.deployment(serve.ingress(app)(OpenAIServer))``. It holds a handle to
the engine — the plain named ``Coordinator`` actor that users also call with
``ray.get(engine.generate.remote(...))`` — and translates between OpenAI's HTTP API and the
engine's ``generate`` / ``generate_stream`` / ``abort``:

    POST /v1/completions        prompt: string or list of token ids; stream: SSE chunks
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 when the engine answers, 503 otherwise

Errors carry OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
requests, 401 for a missing/wrong API key, 429 when the engine's queue or the ingress's
in-flight limit is full (Serve's own queue answers 429 too), 503 when the engine is gone.
A client that disconnects cancels its generation (the request id is aborted in the engine).

Application builders: ``build_app(engine, model_name)`` for an engine that already runs (tests,
the CLI), ``app_builder(args)`` for ``serve run serve_config.yaml`` (creates the engine).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.actor import ActorHandle

from .runtime.coordinator import EngineError, EngineOverloaded

log = logging.getLogger(__name__)

DEFAULT_ENGINE = "powerinfer-engine"
ENGINE_NAMESPACE = "powerinfer"  # where app_builder and the CLI put the engine
DEFAULT_MAX_IN_FLIGHT = 256  # generations admitted by one ingress replica (more: 429)
DEFAULT_MAX_QUEUED = 64  # requests Serve's proxy may hold for the replica (more: 429)
ENGINE_STOP_S = 30.0  # serve CLI on Ctrl-C: how long the engine may take to stop before Ray is stopped anyway
STOP_LIMIT = 4  # OpenAI accepts at most four stop sequences

app = FastAPI(title="powerinfer-ray", docs_url=None, redoc_url=None, openapi_url=None)


# ------------------------------------------------------------------------------------------------
# errors: OpenAI's body
# ------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str) -> APIError:
    return APIError(429, message, type_="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})


@app.exception_handler(APIError)
async def _api_error_handler(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def engine_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised by the engine actor."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
    msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    if isinstance(cause, EngineOverloaded):
        return overloaded(msg)
    if isinstance(cause, ValueError):  # the engine's validation: sampling params, prompt length
        if "context" in msg:
            return bad_request(msg, "prompt", "context_length_exceeded")
        param = next((p for p in ("prompt", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
                      if msg.startswith(p)), None)
        return bad_request(msg, param)
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return APIError(503, f"the engine is unavailable: {msg}", type_="server_error", code="engine_unavailable")
    if isinstance(cause, EngineError):
        return APIError(500, msg, type_="server_error", code="generation_failed")
    log.error("engine call failed: %r", exc)
    return APIError(500, f"{type(cause).__name__}: {msg}", type_="server_error")


# ------------------------------------------------------------------------------------------------
# requests: JSON body -> engine call
# ------------------------------------------------------------------------------------------------
@dataclass
class GenerationCall:
    """What one HTTP request asks of the engine."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        kw = dict(self.sampling)
        if self.prompt_token_ids is not None:
            kw["prompt_token_ids"] = self.prompt_token_ids
        return kw


# parameters we do not implement: accepted only at their "off" value, else 400
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}), "tools": (None, []),
               "functions": (None, []), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        raise bad_request("missing required field 'model'", "model", "missing_field")
    if model != served:
        raise bad_request(f"model {model!r} is not served here; expected {served!r}", "model", "model_not_found")


def parse_sampling(body: dict[str, Any], default_max_tokens: int, max_tokens_field: str = "max_tokens") -> dict:
    """SamplingParams keywords from OpenAI's fields (400 naming the field on a bad value)."""
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise bad_request(f"{name}={body[name]!r} is not supported by this server", name, "unsupported_parameter")
    if body.get("n") not in (1, None):
        raise bad_request(f"n is {body['n']!r}; this server generates one choice per request (n=1)", "n")
    if body.get(max_tokens_field) is None:
        max_tokens_field = "max_tokens"  # chat: max_completion_tokens, or the older max_tokens
    return dict(max_tokens=_integer(body, max_tokens_field, default_max_tokens, lo=1),
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                top_k=max(0, _integer(body, "top_k", 0, lo=-1)),  # 0 or -1: off (as in vLLM)
                seed=_integer(body, "seed", None),
                stop=_parse_stop(body.get("stop")), **_extensions(body))


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo):
        raise bad_request(f"{name} is {v!r}, expected an integer" + (f" >= {lo}" if lo is not None else ""), name)
    return v


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad_request(f"{name} is {v!r}, expected a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", name)
    return float(v)


def _parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > STOP_LIMIT:
        raise bad_request(f"stop is {stop!r}, expected a non-empty string or a list of at most {STOP_LIMIT}", "stop")
    return stops


def _extensions(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style extensions: ignore_eos, stop_token_ids."""
    out: dict[str, Any] = {}
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = parse_flag(body, "ignore_eos")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise bad_request(f"stop_token_ids is {ids!r}, expected a list of integers", "stop_token_ids")
        out["stop_token_ids"] = ids
    return out


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from ``stream`` and ``stream_options``."""
    stream = parse_flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream or not isinstance(opts, dict):
        raise bad_request("stream_options is only allowed with stream=true, as an object", "stream_options")
    return stream, bool(opts.get("include_usage", False))


def parse_flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name) or False
    if not isinstance(value, bool):
        raise bad_request(f"{name} is {value!r}, expected a boolean", name)
    return value


def parse_prompt(prompt: Any, n_vocab: int) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a completion prompt: a string or a list of token ids (batches: 400)."""
    if prompt is None:
        raise bad_request("missing required field 'prompt'", "prompt", "missing_field")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise bad_request(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {n_vocab})", "prompt")
        return None, list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"batched prompts ({len(prompt)}) are not supported: send one request per prompt",
                          "prompt")
    raise bad_request("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as [{"role", "content"}] with text content (content parts joined)."""
    if messages is None:
        raise bad_request("missing required field 'messages'", "messages", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        out.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    return out


def _message_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


# ------------------------------------------------------------------------------------------------
# chat template
# ------------------------------------------------------------------------------------------------
class ChatTemplate:
    """Messages -> prompt text: the GGUF ``tokenizer.chat_template`` rendered with jinja2 (as HF
    renders it) when the model has one and jinja2 is installed, else plain "role: content" lines."""

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "", add_bos: bool = True) -> None:
        self.bos_token, self.eos_token, self.add_bos = bos_token or "", eos_token or "", add_bos
        self.jinja = _compile(template) if template else None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.jinja is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        try:
            text = self.jinja.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as exc:  # noqa: BLE001  (template errors are the request's: raise_exception, bad roles)
            raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from exc
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]  # the engine's tokenizer adds BOS itself
        return text


def _compile(template: str):  # noqa: ANN202  (jinja2.Template | None)
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("jinja2 is not installed: chat prompts use the plain 'role: content' template")
        return None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters.setdefault("tojson", lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent))
    try:
        return env.from_string(template)
    except TemplateError as exc:
        log.warning("the model's chat template does not compile (%s): using the plain template", exc)
        return None


# ------------------------------------------------------------------------------------------------
# responses
# ------------------------------------------------------------------------------------------------
def usage(stats: dict[str, Any]) -> dict[str, int]:
    p, c = int(stats.get("prompt_tokens", 0)), int(stats.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class ResponseFormat:
    """OpenAI's response and stream-chunk objects of one request (completion or chat)."""

    chat: bool
    id: str
    model: str
    token_ids: bool = False  # vLLM's return_token_ids extension
    created: int = field(default_factory=lambda: int(time.time()))

    def _obj(self, kind: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def response(self, out: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out["finish_reason"]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out["text"]}
        else:
            choice["text"] = out["text"]
        extra: dict[str, Any] = {"usage": usage(out["stats"])}
        if self.token_ids:
            choice["token_ids"], extra["prompt_token_ids"] = out["token_ids"], out["prompt_token_ids"]
        return self._obj("chat.completion" if self.chat else "text_completion", [choice], **extra)

    def events(self, chunk: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
        """The stream chunks of one engine chunk (a text delta, then on the last the finish
        reason and, when asked, the usage); empty deltas are skipped."""
        reason, out = chunk.get("finish_reason"), []
        if chunk["text"] or (self.token_ids and chunk["token_ids"]) or (reason and not self.chat):
            out.append(self.chunk(chunk["text"], None if self.chat else reason, ids=chunk["token_ids"]))
        if reason and self.chat:
            out.append(self.chunk(None, reason))
        if reason and include_usage:
            out.append(self.usage_chunk(chunk.get("stats") or {}))
        return out

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              ids: list[int] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids and ids is not None:
            choice["token_ids"] = ids
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._obj("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, stats: dict[str, Any]) -> dict[str, Any]:
        return self._obj("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(stats))


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _next_chunk(gen: Any) -> dict[str, Any] | None:
    """The next chunk of an engine stream (None at its end); engine errors become APIError."""
    try:
        return await (await gen.__anext__())
    except StopAsyncIteration:
        return None
    except Exception as exc:  # noqa: BLE001  (mapped to its HTTP error)
        raise engine_error(exc) from exc


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item


# ------------------------------------------------------------------------------------------------
# the ingress
# ------------------------------------------------------------------------------------------------
def resolve_engine(engine: str | ActorHandle, engine_kwargs: dict[str, Any] | None = None,
                   namespace: str | None = None) -> ActorHandle:
    """The engine actor: a handle as given, the named actor, or (with engine_kwargs) one created now."""
    if not isinstance(engine, str):
        return engine
    if engine_kwargs is None:
        return ray.get_actor(engine, namespace=namespace)
    from .actors.coordinator import Coordinator

    handle = Coordinator.options(name=engine, namespace=namespace, get_if_exists=True,
                                 max_concurrency=1000).remote(name=engine, **engine_kwargs)
    ray.get(handle.ready.remote())
    return handle


class OpenAIServer:
    """OpenAI's HTTP API over the engine actor (a plain class: ``build_app`` makes it a deployment)."""

    def __init__(self, engine: str | ActorHandle = DEFAULT_ENGINE, model_name: str | None = None, *,
                 api_key: str | None = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 engine_kwargs: dict[str, Any] | None = None, namespace: str | None = None) -> None:
        self.engine = resolve_engine(engine, engine_kwargs, namespace)
        info = ray.get(self.engine.model_info.remote())
        self.model_name = model_name or info["name"]
        self.n_ctx, self.n_vocab = int(info["n_ctx"]), int(info["n_vocab"])
        self.template = ChatTemplate(info.get("chat_template"), info.get("bos_token") or "",
                                     info.get("eos_token") or "", bool(info.get("add_bos", True)))
        self.api_key = api_key or None
        self.max_in_flight, self.in_flight = max_in_flight, 0
        self.created = int(time.time())

    # --- routes ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await asyncio.wait_for(asyncio.ensure_future(self.engine.ready.remote()), timeout=10)
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
    async def completions(self, request: Request) -> Any:
        self._authorize(request)
        body = await _json_body(request)
        check_model(body, self.model_name)
        prompt, ids = parse_prompt(body.get("prompt"), self.n_vocab)
        stream, include_usage = parse_stream(body)
        call = GenerationCall(prompt, ids, parse_sampling(body, default_max_tokens=16), stream, include_usage)
        return await self._serve(call, self._format(False, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        self._authorize(request)
        body = await _json_body(request)
        check_model(body, self.model_name)
        prompt = self.template.render(parse_messages(body.get("messages")))
        stream, include_usage = parse_stream(body)
        sampling = parse_sampling(body, default_max_tokens=self.n_ctx, max_tokens_field="max_completion_tokens")
        call = GenerationCall(prompt, None, sampling, stream, include_usage)
        return await self._serve(call, self._format(True, body))

    def _format(self, chat: bool, body: dict[str, Any]) -> ResponseFormat:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return ResponseFormat(chat, rid, self.model_name, token_ids=parse_flag(body, "return_token_ids"))

    # --- generation --------------------------------------------------------------------------------
    async def _serve(self, call: GenerationCall, fmt: ResponseFormat) -> Any:
        if self.in_flight >= self.max_in_flight:
            raise overloaded(f"{self.in_flight} generations in flight (limit {self.max_in_flight}); retry later")
        self.in_flight += 1
        if call.stream:  # from here the stream owns the slot and releases it
            events = self._events(call, fmt)
            first = await events.__anext__()  # errors before the first token are HTTP errors
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": fmt.id})
        try:
            out = await self._generate(call, fmt.id)
        finally:
            self.in_flight -= 1
        return JSONResponse(fmt.response(out))

    async def _generate(self, call: GenerationCall, request_id: str) -> dict[str, Any]:
        ref = self.engine.generate.remote(call.prompt, request_id=request_id, **call.engine_kwargs())
        try:
            return await ref
        except asyncio.CancelledError:  # the client went away: free its slot in the engine
            self.engine.abort.remote(request_id)
            raise
        except Exception as exc:  # noqa: BLE001  (mapped to its HTTP error)
            raise engine_error(exc) from exc

    async def _events(self, call: GenerationCall, fmt: ResponseFormat) -> AsyncIterator[bytes]:
        """SSE bytes of one streamed generation; aborts it in the engine if the client leaves."""
        gen = self.engine.generate_stream.remote(call.prompt, request_id=fmt.id, **call.engine_kwargs())
        finished = False
        try:
            chunk = await _next_chunk(gen)
            if fmt.chat:
                yield sse(fmt.chunk("", role=True))
            while chunk is not None:
                for event in fmt.events(chunk, call.include_usage):
                    yield sse(event)
                if chunk.get("finish_reason"):
                    finished = True
                    break
                try:
                    chunk = await _next_chunk(gen)
                except APIError as exc:  # mid-stream: the status is sent already, report in-band
                    finished = True
                    yield sse(exc.body())
                    break
            yield sse("[DONE]")
        finally:
            if not finished:
                self.engine.abort.remote(fmt.id)
            self.in_flight -= 1

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


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    return body


# ------------------------------------------------------------------------------------------------
# application builders
# ------------------------------------------------------------------------------------------------
def deployment(max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, max_queued: int = DEFAULT_MAX_QUEUED,
               name: str = "OpenAIServer"):  # noqa: ANN201  (serve.Deployment)
    """The ingress as a Serve deployment: one replica, no CPU reserved (the engine and executors
    hold the cores), Serve admitting a bit more than our own in-flight limit so that our 429
    answers before Serve's queue fills, and Serve's queue bounded (429 too)."""
    from ray.serve.config import BackpressureConfig

    return serve.deployment(OpenAIIngress, name=name, num_replicas=1, ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=max_in_flight + 16, max_queued_requests=max_queued,
                            backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1))


def build_app(engine: str | ActorHandle = DEFAULT_ENGINE, model_name: str | None = None,
              api_key: str | None = None, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
              max_queued: int = DEFAULT_MAX_QUEUED, namespace: str | None = None) -> serve.Application:
    """The Serve application over a running engine (a handle, or its name, looked up here)."""
    handle = resolve_engine(engine, namespace=namespace) if isinstance(engine, str) else engine
    return deployment(max_in_flight, max_queued).bind(handle, model_name, api_key=api_key,
                                                      max_in_flight=max_in_flight)


# serve_config args and their types (``serve run module:app_builder k=v`` passes strings)
ARG_TYPES: dict[str, type] = {
    "model": str, "vram_budget": float, "threads": int, "device": str, "n_ctx": int, "max_batch": int,
    "policy": str, "reset_gpu_index": bool, "disable_gpu_index": bool, "prefill_chunk": int, "dtype": str,
    "max_ongoing": int, "engine_name": str, "model_name": str, "api_key": str, "max_in_flight": int,
    "max_queued": int, "graphs": bool,
}
ENGINE_ARGS = ("vram_budget", "threads", "device", "n_ctx", "max_batch", "policy", "reset_gpu_index",
               "disable_gpu_index", "prefill_chunk", "dtype", "max_ongoing", "graphs")


def parse_args(args: dict[str, Any]) -> dict[str, Any]:
    """Typed serve_config args (None values dropped); unknown names and bad values raise ValueError."""
    unknown = sorted(set(args) - set(ARG_TYPES))
    if unknown:
        raise ValueError(f"unknown serve_config args {unknown}; expected some of {sorted(ARG_TYPES)}")
    return {k: _typed(k, v) for k, v in args.items() if v is not None}


def _typed(name: str, value: Any) -> Any:
    kind, text = ARG_TYPES[name], str(value).lower()
    if kind is bool and text in ("true", "false", "1", "0", "yes", "no"):
        return text in ("true", "1", "yes")
    if kind is not bool and not isinstance(value, bool):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"serve_config arg {name}={value!r}: expected {kind.__name__}")


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Application builder of ``serve run serve_config.yaml``: the ingress creates (or finds) the
    engine named ``engine_name`` in namespace ``powerinfer``, owned by the ingress replica.

    args: model (GGUF path or planted:<shape>; default: the embedded tiny model), vram_budget (GiB),
    threads, device, n_ctx, max_batch, policy, reset_gpu_index, disable_gpu_index, prefill_chunk,
    dtype, max_ongoing (engine queue), graphs (false: eager decode steps), engine_name, model_name,
    api_key (default: env POWERINFER_API_KEY), max_in_flight, max_queued.
    """
    a = parse_args(args)
    engine_kwargs = {k: a[k] for k in ENGINE_ARGS if k in a}
    engine_kwargs["model"] = a.get("model") or _default_model()
    max_in_flight = a.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT)
    dep = deployment(max_in_flight, a.get("max_queued", DEFAULT_MAX_QUEUED))
    return dep.bind(a.get("engine_name", DEFAULT_ENGINE), a.get("model_name"),
                    api_key=a.get("api_key") or os.environ.get("POWERINFER_API_KEY"),
                    max_in_flight=max_in_flight, engine_kwargs=engine_kwargs, namespace=ENGINE_NAMESPACE)


def _default_model() -> str:
    from .model.default import default_model_path

    return str(default_model_path())


# ------------------------------------------------------------------------------------------------
# the CLI
# ------------------------------------------------------------------------------------------------
def serve_cli(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
              name: str = DEFAULT_ENGINE, **engine_kwargs: Any) -> int:
    """``powerinfer-ray serve``: start Ray and the engine, then serve the app until interrupted."""
    from .generate import init_ray, start_engine

    init_ray(dashboard=True, quiet=False, namespace=ENGINE_NAMESPACE)  # other drivers find the engine there
    _stop_on_signals()  # after ray.init, whose own SIGTERM handler exits without this cleanup
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    engine, info = start_engine(model, name=name, **engine_kwargs)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build_app(engine, info["model"], api_key=api_key), name="powerinfer")  # returns when ready
        print(_banner(host, port, info["model"], name, api_key), flush=True)
        while True:  # serve.run(blocking=True), with the banner printed once the app answers
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:  # each step says what it does, so a slow stop shows where it waits
        t0 = time.monotonic()
        print("stopping: the Serve app and proxies ...", flush=True)
        try:
            serve.shutdown()  # Serve bounds its controller's graceful shutdown at 30 s
        except Exception as exc:  # noqa: BLE001 -- the engine and Ray must still stop
            print(f"stopping: Serve did not stop cleanly ({type(exc).__name__}: {exc})", flush=True)
        print(f"stopping: the engine ... ({time.monotonic() - t0:.1f} s)", flush=True)
        try:
            ray.get(engine.shutdown.remote(), timeout=ENGINE_STOP_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
            print(f"stopping: the engine did not stop cleanly ({type(exc).__name__}); stopping Ray anyway", flush=True)
        print(f"stopping: Ray ... ({time.monotonic() - t0:.1f} s)", flush=True)
        ray.shutdown()
        print(f"stopped ({time.monotonic() - t0:.1f} s)", flush=True)
    return 0


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM (kill, docker stop, systemd) both stop the server through the same
    clean shutdown. SIGINT explicitly: a process started in the background by a non-interactive
    shell inherits SIGINT ignored, and Python then leaves it ignored."""
    def stop(signum, frame):  # noqa: ANN001, ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, stop)


def _banner(host: str, port: int, model: str, engine: str, api_key: str | None) -> str:
    url = f"http://{host}:{port}"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    body = json.dumps({"model": model, "prompt": "The meaning of", "max_tokens": 32})
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "stream": True})
    return (f"serving {model} at {url}/v1 (engine actor {engine!r}, namespace {ENGINE_NAMESPACE!r})\n"
            f"  curl {url}/v1/models{auth}\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
            f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{chat}'\n"
            f"Ctrl-C (or SIGTERM) stops the server.")
