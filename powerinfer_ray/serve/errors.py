"""HTTP errors with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, and the
mapping of the engine's exceptions onto them."""
from __future__ import annotations

import logging
import re
from typing import Any

import ray
from fastapi.responses import JSONResponse

from ..runtime.scheduler import EngineError, EngineOverloaded

log = logging.getLogger(__name__)

# the fields the engine's ValueErrors name first ("max_tokens is 0, expected ...")
ENGINE_PARAMS = ("prompt_token_ids", "prompt", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop",
                 "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "token_ids")


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


def engine_error(exc: BaseException, engine: str = "the engine") -> APIError:
    """The HTTP error for an exception raised by the engine actor named ``engine``."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
    msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    if isinstance(cause, EngineOverloaded):
        return overloaded(msg)
    if isinstance(cause, ValueError):  # the engine's validation: sampling params, prompt length
        param = next((p for p in ENGINE_PARAMS if re.match(rf"{p}\b", msg)), None)
        if param == "prompt_token_ids":
            param = "prompt"
        code = "context_length_exceeded" if "context" in msg else None
        return bad_request(msg, param or ("prompt" if code else None), code)
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return APIError(503, f"{engine} is unavailable (its process or node is gone; Ray restarts it): {msg}",
                        type_="server_error", code="engine_unavailable")
    if isinstance(cause, EngineError):
        return APIError(500, msg, type_="server_error", code="generation_failed")
    log.error("engine call failed: %r", exc)
    return APIError(500, f"{type(cause).__name__}: {msg}", type_="server_error")
