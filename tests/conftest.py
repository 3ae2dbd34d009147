"""Shared fixtures: one real local Ray cluster per test session (num_cpus=2, like CI)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# loopback-only test clusters: no token (``ray start``, which the scale-out tests run, turns token
# authentication on by default, and a process reads the mode once, so it holds for the session)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """ray.init(num_cpus=2) with the node's Prometheus /metrics endpoint on a known port
    (``ray_cluster.metrics_port``), so tests can read what the dashboard would show."""
    import ray
    from ray_nodes import init_local_ray

    init_local_ray(free_port())
    yield ray
    ray.shutdown()
