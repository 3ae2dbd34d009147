"""A real multi-node Ray cluster on one machine, for the scale-out tests: each node a ``ray start
--block`` process of its own (free ports, its own custom resources), killed like a machine that
dies (SIGKILL to the node's process and every process under it) and started again.

Only this helper's processes are ever signalled, by their pids: other Ray clusters on the machine
(other test sessions) are left alone; ``ray stop`` would stop them all. ``RAY_AUTH_MODE=disabled``:
``ray start`` turns token authentication on by default, which a loopback test cluster does without.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# the head notices a dead node within ~3 s (Ray's default health check takes ~30 s); its processes
# export their metrics every second (default: 10 s)
HEAD_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3", "RAY_metrics_report_interval_ms": "1000"}
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (Ray's workers run in process groups of their own, so a
    process group does not hold them all)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Node:
    """One ``ray start --block`` process and the Ray processes it starts."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        ray_bin = str(Path(sys.executable).with_name("ray"))
        self.log = log
        self.metrics_port = free_port()  # the node's Prometheus /metrics endpoint
        ports = [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                 f"--metrics-export-port={self.metrics_port}", f"--runtime-env-agent-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"]
        with open(log, "a") as out:
            self.proc = subprocess.Popen([ray_bin, "start", "--block", "--disable-usage-stats", *ports, *args],
                                         stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def pids(self) -> set[int]:
        return set(descendants(self.proc.pid))

    def kill(self) -> None:
        """SIGKILL the node and everything under it, as a machine that dies."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


class LocalCluster:
    """A head node and worker nodes on this machine (``add``, ``Node.kill``); ``stop`` kills them all."""

    def __init__(self, tmp: Path, head_cpus: int, head_resources: dict[str, float], num_gpus: int = 0) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(ENV)
        self.nodes: list[Node] = []
        self.head = self._start(["--head", f"--port={self.port}", f"--temp-dir={tmp / 'ray'}",
                                 "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                                 f"--num-gpus={num_gpus}"], head_cpus, head_resources, HEAD_ENV)

    def _start(self, args: list[str], cpus: int, resources: dict[str, float], extra_env: dict | None = None) -> Node:
        node = Node([*args, f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}"],
                    self.tmp / f"node-{len(self.nodes)}.log", {**self.env, **(extra_env or {})})
        self.nodes.append(node)
        return node

    def add(self, cpus: int, resources: dict[str, float]) -> Node:
        """A worker node joining the head."""
        return self._start([f"--address={self.address}"], cpus, resources)

    def wait_nodes(self, ray, n: int, timeout: float = 120.0) -> None:  # noqa: ANN001
        """Until n nodes are alive; fails at once when a node's ``ray start`` exited, with its log."""
        deadline = time.time() + timeout
        while sum(1 for x in ray.nodes() if x["Alive"]) != n:
            exited = [node for node in self.nodes if node.proc.poll() is not None]
            assert not exited and time.time() < deadline, (f"the cluster did not reach {n} alive nodes "
                                                          f"({'a node exited' if exited else f'in {timeout} s'})\n"
                                                          f"{self.diagnosis()}")
            time.sleep(0.25)

    def diagnosis(self) -> str:
        """Each node's ``ray start``: running or its exit code, and the end of its log."""
        out = []
        for i, node in enumerate(self.nodes):
            rc = node.proc.poll()
            try:
                tail = node.log.read_text(errors="replace").splitlines()[-15:]
            except OSError as e:
                tail = [f"(no log: {e})"]
            out.append(f"node {i} ({'running' if rc is None else f'exited {rc}'}), {node.log}:\n  " + "\n  ".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            if node.proc.poll() is None:
                node.kill()


def connect(ray, address: str, timeout: float = 120.0) -> None:  # noqa: ANN001
    """ray.init to the cluster at ``address`` once its head answers, as the cluster's second job.

    Ray derives actor ids from the job id, and a fresh cluster's first job is always 01: a handle
    this process still held from another cluster's job 01 would, when Python drops it, release the
    new actor of the same id. Hence garbage is collected before leaving a cluster (``leave``) and
    this process joins as job 02 (a first connection is made and dropped)."""
    deadline = time.time() + timeout
    for _ in range(2):
        while True:
            try:
                ray.init(address=address, log_to_driver=False, namespace="powerinfer")
                break
            except ConnectionError:
                if time.time() > deadline:
                    raise
                time.sleep(1)
        if ray.get_runtime_context().get_job_id() != "01000000":
            return
        ray.shutdown()


def leave(ray) -> None:  # noqa: ANN001
    """ray.shutdown after the handles no longer referenced are released in the cluster they belong to."""
    gc.collect()
    ray.shutdown()


def init_local_ray(metrics_port: int) -> None:
    """The session's local Ray: 2 CPUs like CI, the node's Prometheus /metrics endpoint on
    ``metrics_port`` (``ray.metrics_port``), so that tests can read what the dashboard would show."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    ray.metrics_port = metrics_port
