"""Shared fixtures: one real local Ray cluster per test session (num_cpus=2, like CI)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# loopback-only test clusters: no token (``ray start``, which the scale-out tests run, turns token
# authentication on by default, and a process reads the mode once, so it holds for the session)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_configure(config):
    """OMP_NUM_THREADS as torch's thread count even above the machine's cores (torch caps the
    variable there): ``scripts/test.sh --portable`` runs the suite at 4 threads on a 2-core CI."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def pytest_report_header(config):
    """The conditions that change fp32 rounding (``scripts/test.sh --portable``)."""
    import torch

    flags = os.environ.get("POWERINFER_RAY_CPU_CFLAGS", "")
    return (f"fp32 paths: torch {torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()}; "
            f"CPU kernels -march=native {flags}".rstrip())


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


@pytest.fixture(scope="session")
def ray_cluster():
    """ray.init(num_cpus=2) with the node's Prometheus /metrics endpoint on a known port
    (``ray_cluster.metrics_port``), so tests can read what the dashboard would show."""
    import ray
    from ray_nodes import free_port, init_local_ray

    init_local_ray(free_port())
    yield ray
    ray.shutdown()
