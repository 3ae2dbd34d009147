"""Application builders: ``build_app(engine)`` over an engine (or replicas) that already runs
(tests, the CLI), ``app_builder(args)`` for ``serve run serve_config.yaml`` (it creates the engine,
or ``replicas`` of it, from its args).

The args of ``app_builder`` are the engine's options (``runtime.config.EngineConfig``), the
ingress's (``IngressConfig``) and the replicas' (``ReplicaConfig``), by the same names as the
CLI's flags.
"""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Sequence

from ray import serve
from ray.actor import ActorHandle

from ..runtime.config import EngineConfig, coerce, exposed_fields
from . import ENGINE_NAMESPACE
from .config import DEFAULT_ENGINE, DEFAULT_MAX_IN_FLIGHT, IngressConfig, ReplicaConfig, environment, serving
from .ingress import OpenAIIngress, resolve_engine

HEAD_NODE = "node:__internal_head__"  # Ray's resource of the head node, where the HTTP proxy runs

RESERVE = 64  # requests beyond max_in_flight that the replica takes in, to answer them 429 itself


def deployment(max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, name: str = "OpenAIServer"):  # noqa: ANN201
    """The ingress as a Serve deployment: one replica on the head node, beside the HTTP proxy (a
    worker node that dies takes only its engines), no CPU reserved (the engines hold the cores).
    Every answer comes from our ingress, with OpenAI's body: Serve admits ``RESERVE`` requests
    beyond our in-flight limit so that the ingress answers them 429 at once, and Serve's own queue
    is unbounded, so that Serve never answers 429 in plain text."""
    return serve.deployment(OpenAIIngress, name=name, num_replicas=1,
                            ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE: 0.001}},
                            max_ongoing_requests=max_in_flight + RESERVE, max_queued_requests=-1)


def build_app(engine: str | ActorHandle | Sequence[Any] = DEFAULT_ENGINE, model_name: str | None = None,
              api_key: str | None = None, *, namespace: str | None = None, **ingress: Any) -> serve.Application:
    """The Serve application over a running engine (a handle, or its name, looked up here) or over
    replicas (``actors.replicas.start_replicas``'s list); ingress: the other ``IngressConfig``
    fields (max_in_flight, max_body_bytes, body_timeout_s)."""
    handle = resolve_engine(engine, namespace=namespace) if isinstance(engine, str) else engine
    ic = IngressConfig(model_name=model_name, api_key=api_key, **ingress)
    return deployment(ic.max_in_flight).bind(handle, ic.model_name, **_server_kwargs(ic))


def _server_kwargs(ic: IngressConfig) -> dict[str, Any]:
    """OpenAIServer's keywords from an ingress config (all but the engine and model names)."""
    return {"api_key": ic.api_key, "max_in_flight": ic.max_in_flight, "max_body_bytes": ic.max_body_bytes,
            "body_timeout_s": ic.body_timeout_s}


def parse_args(args: dict[str, Any]) -> tuple[EngineConfig, IngressConfig, ReplicaConfig]:
    """The engine's, the ingress's and the replicas' configs from serve_config args (null: the
    default; strings from ``serve run module:app_builder k=v`` are converted); unknown names raise
    ValueError."""
    parts = (EngineConfig, IngressConfig, ReplicaConfig)
    names = [{f.name for f in (exposed_fields(c) if c is EngineConfig else fields(c))} for c in parts]
    known = {"model"}.union(*names)
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown serve_config args {unknown}; expected some of {sorted(known)}")
    given = {k: v for k, v in args.items() if v is not None}
    engine, ingress, replicas = ({k: coerce(c, k, v) for k, v in given.items() if k in n} for c, n in zip(parts, names))
    ingress.setdefault("api_key", environment()["POWERINFER_API_KEY"])
    return (EngineConfig(model=str(given.get("model") or _default_model()), **engine), IngressConfig(**ingress),
            ReplicaConfig(**replicas))


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Application builder of ``serve run serve_config.yaml``: the ingress creates (or finds) the
    engine named ``engine_name`` in namespace ``powerinfer``, or ``replicas`` of it (named
    ``engine_name-<i>``), owned by the ingress replica.
    args: see ``parse_args`` (model: GGUF path or planted:<shape>; default: the embedded model)."""
    ec, ic, rc = parse_args(args)
    ec = serving(ec)
    options = {f.name: getattr(ec, f.name) for f in exposed_fields(EngineConfig)}
    return deployment(ic.max_in_flight).bind(ic.engine_name, ic.model_name, **_server_kwargs(ic),
                                             engine_options={"model": ec.model, **options}, namespace=ENGINE_NAMESPACE,
                                             replicas=asdict(rc))


def _default_model() -> str:
    from ..model.default import default_model_path

    return str(default_model_path())
