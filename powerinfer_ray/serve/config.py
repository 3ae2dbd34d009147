"""The HTTP front end's settings as data: ``powerinfer-ray serve`` flags and serve_config args
are made from these fields, as the engine's are from ``runtime.config``."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..runtime.config import EngineConfig, check_int, check_number, option

DEFAULT_ENGINE = "powerinfer-engine"
DEFAULT_MAX_IN_FLIGHT = 256  # generations admitted by one ingress replica (more: 429)
DEFAULT_MAX_BODY_BYTES = 4 << 20  # request bodies beyond this get 413
DEFAULT_BODY_TIMEOUT_S = 10.0  # request bodies slower than this get 408
ENVIRONMENT = ("RAY_ADDRESS", "POWERINFER_API_KEY")


def environment() -> dict[str, str | None]:
    """The front door's environment, read here only: RAY_ADDRESS (Ray's own: join that cluster
    rather than start one here) and POWERINFER_API_KEY (the API key when the config names none:
    a secret is better kept out of files). The package's other read is the compiled kernels'
    cache folder, $POWERINFER_RAY_CACHE (kernels/cpu_library.py)."""
    return {name: os.environ.get(name) or None for name in ENVIRONMENT}


def serving(ec: EngineConfig) -> EngineConfig:
    """The engine's config as a server runs it: its defaults for serving where the user left a
    field out (re-placement 'auto': a server's traffic is not its profile's)."""
    return ec if ec.replacement is not None else replace(ec, replacement="auto")


@dataclass(frozen=True)
class IngressConfig:
    """The ingress's settings."""

    engine_name: str = option(DEFAULT_ENGINE, "name of the engine actor (Ray namespace 'powerinfer')")
    model_name: str | None = option(None, "the model name clients send (default: the file's general.name)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (serve_config default: "
                                 "$POWERINFER_API_KEY, or no key)")
    max_in_flight: int = option(DEFAULT_MAX_IN_FLIGHT, "generations the ingress admits at once (more: 429)",
                                kind=int)
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "largest request body accepted (more: 413)", kind=int)
    body_timeout_s: float = option(DEFAULT_BODY_TIMEOUT_S, "seconds a request body may take to arrive (more: 408)",
                                   kind=float)

    def __post_init__(self) -> None:
        check_int("max_in_flight", self.max_in_flight, 1)
        check_int("max_body_bytes", self.max_body_bytes, 1024)
        check_number("body_timeout_s", self.body_timeout_s, 0.0, lo_open=True)


@dataclass(frozen=True)
class ReplicaConfig:
    """How many engines serve the app and what each takes of a node (``actors.replicas``)."""

    replicas: int = option(1, "engines behind the app, each a whole engine (coordinator and executors) on one node "
                           "in a placement group of its own, named <engine_name>-<i>; each request goes to the "
                           "one with the fewest tokens in flight. 1: the single engine, without a placement group",
                           kind=int)
    replica_gpus: float = option(1.0, "share of a GPU each replica's GPU executor takes: 1 pins one replica per GPU "
                                 "(data-parallel over a host's GPUs); 0.5 puts two replicas on one GPU", kind=float)
    replica_resource: str | None = option(
        None, "a custom Ray resource each replica takes one unit of: a node started with "
        "--resources '{\"NAME\": k}' hosts at most k replicas (CPU-only nodes; pinning replicas to nodes)")

    def __post_init__(self) -> None:
        check_int("replicas", self.replicas, 1, fix="engines behind the app")
        check_number("replica_gpus", self.replica_gpus, 0.0, 1.0, lo_open=True,
                     fix="a GPU's share per replica: 1, or 0.5 for two replicas on one GPU")
        if self.replica_resource is not None and (not isinstance(self.replica_resource, str)
                                                  or not self.replica_resource.strip()):
            raise ValueError(f"replica_resource={self.replica_resource!r}: expected the name of a custom Ray "
                             "resource (as given to ray start --resources), or null")
