"""Starting things: a local Ray (or the cluster at RAY_ADDRESS), the engine actor (or its replicas)
with a progress line, and ``powerinfer-ray serve``, which serves the app until Ctrl-C or SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from typing import Any

import ray

from ..runtime.config import EngineConfig
from . import ENGINE_NAMESPACE
from .config import ReplicaConfig, environment

ENGINE_STOP_S = 30.0  # on Ctrl-C: how long the engine may take to stop before Ray is stopped anyway


def init_ray(num_cpus: int | None = None, dashboard: bool = False, quiet: bool = True,
             namespace: str | None = None) -> None:
    """Join the cluster named by RAY_ADDRESS, or start a local one (named actors go to ``namespace``)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"include_dashboard": dashboard, "log_to_driver": not quiet, "namespace": namespace}
    if not joins_cluster() and num_cpus is not None:
        kw["num_cpus"] = num_cpus
    ray.init(**kw)


def joins_cluster() -> bool:
    """Whether ``init_ray`` joins an existing cluster (RAY_ADDRESS) rather than starting one here."""
    return environment()["RAY_ADDRESS"] is not None


def engine_options(ec: EngineConfig) -> dict[str, Any]:
    """The actor's keyword options of a config (every field but the model)."""
    return {f.name: getattr(ec, f.name) for f in fields(ec) if f.name != "model"}


def _spinner(msg: str, stop: threading.Event) -> None:
    t0 = time.perf_counter()
    while not stop.wait(0.5):
        print(f"\r{msg} {time.perf_counter() - t0:5.1f} s", end="", file=sys.stderr, flush=True)
    print(f"\r{msg} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def start_engine(ec: EngineConfig, name: str = "powerinfer-engine"):  # noqa: ANN201
    """Create the engine actor and wait until its executors have loaded (with a progress line);
    a failure of its constructor raises the constructor's own exception (see ``actor_cause``)."""
    from ..actors.coordinator import Coordinator

    engine = Coordinator.options(name=name, max_concurrency=1000).remote(ec.model, **engine_options(ec))
    info = _with_spinner(f"loading {os.path.basename(ec.model)}:", ray.get, engine.ready.remote())
    return engine, info


def start_replicas_waiting(ec: EngineConfig, rc: ReplicaConfig, name: str = "powerinfer-engine"):  # noqa: ANN201
    """Create ``rc.replicas`` engine replicas and wait (with a progress line) until one serves;
    the others may still load or wait for a node with room. Returns them and the first one's
    ready() answer; a failure of every replica raises the constructor's own exception."""
    from ..actors.replicas import start_replicas, stop_replicas

    replicas = start_replicas(ec, rc.replicas, rc.replica_gpus, rc.replica_resource, name=name)
    refs = {r.engine.ready.remote(): r for r in replicas}
    try:
        info = _with_spinner(f"loading {rc.replicas} replicas of {os.path.basename(ec.model)}:", _first_ready, refs)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas, info


def _first_ready(refs: dict[Any, Any]) -> dict[str, Any]:
    """The first ready() answer among ``refs``; the last failure when all fail."""
    pending, error = list(refs), None
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            return ray.get(done[0])
        except ray.exceptions.RayError as exc:
            error = exc
    raise error


def _with_spinner(msg: str, fn: Any, *args: Any) -> Any:  # noqa: ANN401
    """fn(*args) with a progress line; a Ray error is raised as the user's exception inside it."""
    stop = threading.Event()
    th = threading.Thread(target=_spinner, args=(msg, stop), daemon=True)
    th.start()
    try:
        return fn(*args)
    except ray.exceptions.RayError as exc:
        cause = actor_cause(exc)
        if cause is exc:
            raise
        raise cause from exc
    finally:
        stop.set()
        th.join()


def actor_cause(exc: BaseException) -> BaseException:
    """The user's exception inside a Ray error (a task's or an actor constructor's), else exc."""
    seen = exc
    for _ in range(8):
        cause = getattr(seen, "cause", None)
        if cause is None or cause is seen:
            break
        seen = cause
    return seen if isinstance(seen, (ValueError, OSError)) else exc


def serve_cli(ec: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, engine_name: str = "powerinfer-engine",
              model_name: str | None = None, api_key: str | None = None, replicas: ReplicaConfig | None = None,
              **ingress: Any) -> int:  # noqa: ANN401
    """``powerinfer-ray serve``: start Ray and the engine (or its replicas), then serve the app until
    interrupted. The HTTP proxy runs on the head node only."""
    from ray import serve

    from ..actors.replicas import Replica
    from .app import build_app

    rc = replicas or ReplicaConfig()
    init_ray(dashboard=True, quiet=False, namespace=ENGINE_NAMESPACE)  # other drivers find the engine there
    _stop_on_signals()  # after ray.init, whose own SIGTERM handler exits without this cleanup
    if rc.replicas == 1:
        engine, info = start_engine(ec, name=engine_name)
        engines = [Replica(engine_name, engine)]
    else:
        engines, info = start_replicas_waiting(ec, rc, name=engine_name)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    model = model_name or info["model"]
    try:
        app = build_app(engines[0].engine if rc.replicas == 1 else engines, model, api_key=api_key, **ingress)
        serve.run(app, name="powerinfer")  # returns when ready
        print(_banner(host, port, model, [r.name for r in engines], api_key), flush=True)
        while True:  # serve.run(blocking=True), with the banner printed once the app answers
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:  # each step says what it does, so a slow stop shows where it waits
        _stop(serve, engines)
    return 0


def _stop(serve: Any, engines: list[Any]) -> None:  # noqa: ANN401
    from ..actors.replicas import stop_replicas

    t0 = time.monotonic()
    print("stopping: the Serve app and proxies ...", flush=True)
    try:
        serve.shutdown()  # Serve bounds its controller's graceful shutdown at 30 s
    except Exception as exc:  # noqa: BLE001 -- the engine and Ray must still stop
        print(f"stopping: Serve did not stop cleanly ({type(exc).__name__}: {exc})", flush=True)
    print(f"stopping: the engine ... ({time.monotonic() - t0:.1f} s)", flush=True)
    try:
        stop_replicas(engines, timeout_s=ENGINE_STOP_S)
    except ray.exceptions.RayError as exc:
        print(f"stopping: the engine did not stop cleanly ({type(exc).__name__}); stopping Ray anyway", flush=True)
    print(f"stopping: Ray ... ({time.monotonic() - t0:.1f} s)", flush=True)
    ray.shutdown()
    print(f"stopped ({time.monotonic() - t0:.1f} s)", flush=True)


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM (kill, docker stop, systemd) both stop the server through the same
    clean shutdown. SIGINT explicitly: a process started in the background by a non-interactive
    shell inherits SIGINT ignored, and Python then leaves it ignored."""
    def stop(signum, frame):  # noqa: ANN001, ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, stop)


def _banner(host: str, port: int, model: str, engines: list[str], api_key: str | None) -> str:
    url = f"http://{host}:{port}"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    body = json.dumps({"model": model, "prompt": "The meaning of", "max_tokens": 32})
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "stream": True})
    actors = f"engine actor {engines[0]!r}" if len(engines) == 1 else \
        f"{len(engines)} engine replicas {engines[0]!r} ... {engines[-1]!r}; {url}/health lists them"
    return (f"serving {model} at {url}/v1 ({actors}, namespace {ENGINE_NAMESPACE!r})\n"
            f"  curl {url}/v1/models{auth}\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
            f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{chat}'\n"
            f"Ctrl-C (or SIGTERM) stops the server.")
