"""OpenAI's request JSON -> what the engine is asked: every field checked, a 400 naming it on a
bad value, options we do not implement refused by name rather than ignored."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..runtime.prompt import utf8
from ..runtime.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN
from .errors import APIError, bad_request

STOP_LIMIT = 4  # OpenAI accepts at most four stop sequences
MAX_N = 16  # choices per request
CHARS_PER_TOKEN = 4  # a text prompt's weight before it is tokenized (English with a Llama vocabulary: ~4)

# options we do not implement: accepted only at their "off" value, else 400 naming them
UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
               "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
               "response_format": (None, {"type": "text"}), "audio": (None,), "modalities": (None, ["text"]),
               "prediction": (None,), "web_search_options": (None,)}


@dataclass
class GenerationCall:
    """What one HTTP request asks of the engine: the prompt, ``n`` choices of sampling keywords
    (seeds ``seed + i``), streaming, and the completions API's ``echo``."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False

    def tokens(self, n_ctx: int) -> int:
        """What the request weighs on a replica: per choice, the prompt's tokens (a text's estimated
        at CHARS_PER_TOKEN characters a token) and the most it may generate (chat without
        max_tokens: the rest of the context)."""
        prompt = len(self.prompt_token_ids) if self.prompt_token_ids is not None \
            else len(self.prompt or "") // CHARS_PER_TOKEN + 1
        new = self.sampling.get("max_tokens") or max(1, n_ctx - prompt)
        return self.n * (prompt + new)

    def engine_kwargs(self, i: int = 0) -> dict[str, Any]:
        kw = dict(self.sampling)
        if kw.get("seed") is not None and i:
            kw["seed"] = (kw["seed"] + i - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN  # stays in range
        if self.prompt_token_ids is not None:
            kw["prompt_token_ids"] = self.prompt_token_ids
        return kw


def is_int(v: Any) -> bool:  # noqa: ANN401
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:  # noqa: ANN401
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


async def json_body(request: Request, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The request's JSON object, read up to ``max_bytes`` (413 beyond, before reading it all) within
    ``timeout_s`` (408 after: a client that sends its body slowly holds a slot of the replica)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    try:
        raw = await asyncio.wait_for(_read(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (body_timeout_s)",
                       code="request_timeout") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc
    except RecursionError:
        raise bad_request("the request body is nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    return body


async def _read(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"the request body has at least {size} bytes; this server accepts at most {max_bytes} "
                    "(max_body_bytes)", code="request_too_large")


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        raise bad_request("missing required field 'model'", "model", "missing_field")
    if model != served:
        raise bad_request(f"model {model!r} is not served here; expected {served!r}", "model", "model_not_found")


def parse_sampling(body: dict[str, Any], default_max_tokens: int | None, chat: bool = False) -> dict[str, Any]:
    """The engine's sampling keywords from OpenAI's fields (400 naming the field on a bad value)."""
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise bad_request(f"{name}={body[name]!r} is not supported by this server", name, "unsupported_parameter")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return dict(max_tokens=_integer(body, name, default_max_tokens, lo=1),
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                top_k=max(0, _integer(body, "top_k", 0, lo=-1)),  # 0 or -1: off (as in vLLM)
                seed=_integer(body, "seed", None, lo=SEED_MIN, hi=SEED_MAX),
                stop=_parse_stop(body.get("stop")),
                presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                **_logprobs(body, chat), **_extensions(body))


def parse_choices(body: dict[str, Any]) -> int:
    """``n`` (choices per prompt); ``best_of`` only at its default, n."""
    n = _integer(body, "n", 1, lo=1, hi=MAX_N)
    if body.get("best_of") not in (None, n):
        raise bad_request(f"best_of={body['best_of']!r} is not supported by this server (only best_of == n)",
                          "best_of", "unsupported_parameter")
    return n


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The engine's ``logprobs`` (alternatives per token, None: off): chat's ``logprobs`` (a bool)
    with ``top_logprobs``, or the completions API's ``logprobs`` (an integer)."""
    if not chat:
        return {"logprobs": _integer(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)}
    on = parse_flag(body, "logprobs")
    top = _integer(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return {"logprobs": (top or 0) if on else None}


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int | None = None,
             hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise bad_request(f"{name} is {v!r}, expected an integer{span}", name)
    return v


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad_request(f"{name} is {v!r}, expected a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", name)
    return float(v)


def _parse_stop(stop: Any) -> list[str]:  # noqa: ANN401
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > STOP_LIMIT:
        raise bad_request(f"stop is {stop!r}, expected a non-empty string or a list of at most {STOP_LIMIT}", "stop")
    for s in stops:
        text(s, "stop")
    return stops


def _extensions(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style extensions: ignore_eos, stop_token_ids."""
    out: dict[str, Any] = {}
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = parse_flag(body, "ignore_eos")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(is_int(t) for t in ids):
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


def text(value: str, param: str) -> str:
    """A string field that must be valid Unicode (JSON admits lone surrogates, UTF-8 does not)."""
    try:
        utf8(value, param)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None
    return value


def parse_prompt(prompt: Any, n_vocab: int) -> tuple[str | None, list[int] | None]:  # noqa: ANN401
    """(text, token ids) of a completion prompt: a string or a list of token ids (batches: 400)."""
    if prompt is None:
        raise bad_request("missing required field 'prompt'", "prompt", "missing_field")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return text(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise bad_request(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {n_vocab})", "prompt")
        return None, list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"batched prompts ({len(prompt)}) are not supported: send one request per prompt",
                          "prompt")
    raise bad_request("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def parse_messages(messages: Any) -> list[dict[str, str]]:  # noqa: ANN401
    """Chat messages as [{"role", "content"}] with text content (content parts joined)."""
    if messages is None:
        raise bad_request("missing required field 'messages'", "messages", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        out.append({"role": text(m["role"], f"messages[{i}].role"), "content": _message_text(m.get("content"), i)})
    return out


def _message_text(content: Any, i: int) -> str:  # noqa: ANN401
    if content is None or isinstance(content, str):
        return text(content or "", f"messages[{i}].content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return text("".join(p["text"] for p in content), f"messages[{i}].content")
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_token_ids(body: dict[str, Any], name: str, n_vocab: int) -> list[int]:
    ids = body.get(name)
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad_request(f"{name} must be a list of token ids", name)
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise bad_request(f"{name} {bad[:8]} are outside the vocabulary [0, {n_vocab})", name)
    return ids
