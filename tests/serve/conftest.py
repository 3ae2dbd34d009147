"""Fixtures of the Serve tests: engine actors that go away with their module, Serve's HTTP proxy
on a free 127.0.0.1 port, and ``powerinfer-ray serve`` run as a user runs it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import ray_nodes
import waits


@pytest.fixture(scope="session")
def free_port():  # noqa: ANN201
    """free_port(): a free TCP port on 127.0.0.1."""
    return ray_nodes.free_port


@pytest.fixture(scope="session")
def wait_until():
    """wait_until(predicate, timeout, what): waits.wait_until."""
    return waits.wait_until


@pytest.fixture(scope="module")
def engines(ray_cluster):
    """make(name, model, **options): an engine actor, ready; all are shut down after the module."""
    import ray

    from powerinfer_ray.actors.coordinator import Coordinator

    made = []

    def make(name: str, model: str, **options):  # noqa: ANN202
        eng = Coordinator.options(name=name, max_concurrency=1000).remote(str(model), **options)
        ray.get(eng.ready.remote())
        made.append(eng)
        return eng

    yield make
    for eng in made:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)


@pytest.fixture(scope="module")
def serve_url(ray_cluster):
    """Serve's proxy on a free 127.0.0.1 port for this module: its base URL."""
    from ray import serve

    port = ray_nodes.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


class ServeProcess:
    """``python -m powerinfer_ray.cli serve ...`` in its own local Ray, read until its banner."""

    def __init__(self, args: list[str], cwd: str, timeout: float = 180.0) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray, not the tests'
        self.proc = subprocess.Popen([sys.executable, "-m", "powerinfer_ray.cli", "serve", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        self.lines: list[str] = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            assert line or self.proc.poll() is None, self.tail()
            self.lines.append(line)
            if line.startswith("serving "):
                break
        else:
            self.stop()
            pytest.fail(f"no banner within {timeout} s:\n" + self.tail())
        self.url = re.search(r"at (http://\S+)/v1", self.lines[-1]).group(1)
        # keep draining its output: a full pipe would block the server's logging (and its exit)
        self.drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.drain.start()

    def tail(self) -> str:
        return "".join(self.lines[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def serve_process():
    """ServeProcess(args, cwd): ``powerinfer-ray serve`` started; each is killed after the module
    if still running."""
    started = []

    def start(args: list[str], cwd: str, timeout: float = 180.0) -> ServeProcess:
        started.append(ServeProcess(args, cwd, timeout))
        return started[-1]

    yield start
    for server in started:
        server.stop()
