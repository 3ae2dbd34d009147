"""The OpenAI-compatible Ray Serve app: our own FastAPI ingress over the engine actor (or its replicas).

``ray.serve.llm`` needs vLLM, so the front end is a plain class (``ingress.OpenAIServer``) turned
into a deployment. It holds handles to the engines — plain named ``Coordinator`` actors that
users also call with ``ray.get(engine.generate.remote(...))``: one, or replicas on the cluster's
GPUs and nodes (``actors.replicas``), each request sent to the one with the fewest tokens in
flight (``router``) — and translates between OpenAI's HTTP API and the engine's ``generate`` /
``generate_stream`` / ``abort`` / ``encode`` / ``decode``:

    POST /v1/completions        prompt: string or token ids; n, echo, logprobs; stream: SSE chunks
    POST /v1/chat/completions   messages rendered with the model's chat template; logprobs
    GET  /v1/models             the served model
    POST /tokenize, /detokenize vLLM's token endpoints
    GET  /health                each replica's state; 200 while one answers, 503 otherwise

Errors carry OpenAI's body (``errors``): 400 for bad requests, naming the field, 401 for a
missing/wrong API key, 413 for a body over ``max_body_bytes``, 429 when the engine's queue or the
ingress's in-flight limit is full, 503 when no engine answers. Every response carries an
``X-Request-Id`` header; those an engine served, ``X-Powerinfer-Engine``.

Modules: errors, protocol (request checks), responses, chat_template, router (replicas: choice,
states, metrics), ingress, app (builders), launcher (``powerinfer-ray serve``, Ray and engine
start-up). ``serve run
powerinfer_ray.serve:app_builder`` finds the builder here; the heavy modules load on first use.
"""
from __future__ import annotations

from typing import Any

ENGINE_NAMESPACE = "powerinfer"  # where app_builder and the CLI put the engine

_LAZY = {"app_builder": "app", "build_app": "app", "parse_args": "app", "IngressConfig": "config",
         "DEFAULT_ENGINE": "config", "OpenAIServer": "ingress", "OpenAIIngress": "ingress",
         "serve_cli": "launcher", "init_ray": "launcher", "start_engine": "launcher"}


def __getattr__(name: str) -> Any:  # noqa: ANN401
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
