"""Scale-out on a real multi-node Ray cluster on this machine (``ray start --head`` and a second
``ray start --address`` node, each declaring one unit of the custom resource ``powerinfer_replica``):
the app as ``serve run serve_config.yaml`` makes it, with ``replicas: 3`` of the tiny model on the
CPU, so that two start, one on each node, and the third waits for a node with room.

Requests spread over the two replicas and match the dense reference token for token; killing the
second node mid-stream fails only the streams it served, new requests go to the first, and when
the node comes back (with room for two) Ray places the waiting replicas there and they serve.
Deleting the app takes the replicas with it. The head also declares two (fake) GPUs: the bundles
that pin one replica per GPU are checked on them. The module leaves the session's local Ray for
its own cluster and starts it again after.
"""
from __future__ import annotations

import json
import os
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests
import torch
from ray import serve
from ray.util.placement_group import placement_group, remove_placement_group

from powerinfer_ray.actors.executors import RayBackend
from powerinfer_ray.actors.replicas import PLACEMENT_SUFFIX, replica_bundle
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.serve import ENGINE_NAMESPACE
from powerinfer_ray.serve.app import app_builder
from ray_nodes import LocalCluster, connect, free_port, init_local_ray, leave
from ties import assert_greedy

MODEL = "tiny-llama-reglu"
N_CTX = 2048
KEY = "sk-scaleout"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOT = "powerinfer_replica"  # the custom resource: one unit per replica
NAMES = [f"powerinfer-engine-{i}" for i in range(3)]
LONG = 400  # tokens of the streams cut by the node's death: seconds of decoding left when it dies


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("scaleout") / "m.gguf", "llama-reglu", seed=7, n_layer=2,
                            n_ctx=N_CTX)


@pytest.fixture(scope="module")
def greedy(model_path):
    """greedy(prompt, ids, n): assert ids are n tokens of the dense reference's greedy run, up to
    rounding ties (``ties.assert_greedy``), on one torch thread (beside the cluster's processes,
    torch's threads would wait on each other for a busy core)."""
    ref = ReferenceModel.from_file(model_path, dtype=torch.float64)

    def check(prompt: list[int], ids: list[int], n: int) -> None:
        assert len(ids) == n, (prompt, ids)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert_greedy(ref, prompt, ids)
        finally:
            torch.set_num_threads(threads)
    return check


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The head (3 CPUs, 2 fake GPUs, one replica slot) and node B (1 CPU, one slot); this driver
    connected to it. The session's Ray, if it ran, is started again afterwards."""
    session_port = getattr(ray, "metrics_port", None) if ray.is_initialized() else None
    if ray.is_initialized():
        leave(ray)
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), head_cpus=3, head_resources={SLOT: 1}, num_gpus=2)
    try:
        c.add(cpus=1, resources={SLOT: 1})
        try:
            connect(ray, c.address)
        except ConnectionError as e:
            raise AssertionError(f"could not join the cluster at {c.address}: {e}\n{c.diagnosis()}") from e
        c.wait_nodes(ray, 2)
        yield c
    finally:
        leave(ray)
        c.stop()
        if session_port is not None:
            init_local_ray(session_port)


@pytest.fixture(scope="module")
def url(cluster, model_path):
    """The app as ``serve run serve_config.yaml`` makes it, with ``replicas: 3`` (two fit the
    cluster; the ingress starts them and owns them), on a free port: its URL."""
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    args = {"model": str(model_path), "device": "cpu", "policy": "dense", "n_ctx": N_CTX, "max_batch": 8,
            "api_key": KEY, "replicas": 3, "replica_resource": SLOT}
    try:
        serve.run(app_builder(args), name="scaleout", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def _health(url: str) -> dict:
    r = requests.get(f"{url}/health", timeout=30)
    return {"code": r.status_code, **r.json()}


def _states(url: str) -> dict[str, dict]:
    h = _health(url)
    return {r["name"]: r for r in h.get("replicas", [])}


def _node_of(cluster: LocalCluster, pid: int) -> int:
    """Which of the cluster's nodes runs the process ``pid`` (its index in cluster.nodes)."""
    (i,) = [i for i, node in enumerate(cluster.nodes) if node.proc.poll() is None and pid in node.pids()]
    return i


def _complete(url: str, prompt: list[int], max_tokens: int, **extra) -> requests.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=300)


def _stream(url: str, prompt: list[int], max_tokens: int, first: threading.Event | None = None) -> dict:
    """A streamed completion read to its end: the replica named in the header, the token ids, the
    finish reason and the error event if one came."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    out = {"ids": [], "finish": None, "error": None}
    with requests.post(f"{url}/v1/completions", json=body, headers=AUTH, stream=True, timeout=300) as r:
        out["status"], out["engine"] = r.status_code, r.headers.get("x-powerinfer-engine")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            choice = event["choices"][0]
            out["ids"] += choice.get("token_ids") or []
            out["finish"] = choice["finish_reason"] or out["finish"]
            if first is not None:
                first.set()
    if first is not None:
        first.set()
    return out


def _prompts(n: int, seed: int, length: int | None = None) -> list[list[int]]:
    """n prompts of byte tokens, of ``length`` tokens (default: 2 to 11)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 258) for _ in range(length or rng.randrange(2, 12))] for _ in range(n)]


def test_two_replicas_land_on_two_nodes_and_the_third_waits(url, cluster, wait_until):
    states = wait_until(lambda: (s := _states(url)) and sum(r["state"] == "up" for r in s.values()) == 2 and s, 240,
                   "two replicas up")
    assert list(states) == NAMES
    up = [n for n in NAMES if states[n]["state"] == "up"]
    waiting = [n for n in NAMES if n not in up]
    assert len(waiting) == 1 and states[waiting[0]]["state"] == "starting"
    # each node runs one replica's engine process: the head and node B
    assert sorted(_node_of(cluster, states[n]["pid"]) for n in up) == [0, 1]
    assert len({states[n]["node_id"] for n in up}) == 2 and all(states[n]["device"] == "cpu" for n in up)
    h = _health(url)
    assert h["code"] == 200 and h["status"] == "degraded"
    r = requests.get(f"{url}/v1/models", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert requests.get(f"{url}/v1/models", timeout=30).status_code == 401  # the API key still holds


def test_concurrent_requests_spread_over_both_and_match_the_reference(url, greedy, cluster, wait_until):
    prompts = _prompts(32, seed=1)

    def one(k: int) -> tuple[str, list[int]]:
        if k % 4 == 3:  # a quarter streamed
            s = _stream(url, prompts[k], 8)
            assert s["status"] == 200 and s["error"] is None and s["finish"] == "length", s
            return s["engine"], s["ids"]
        r = _complete(url, prompts[k], 8)
        assert r.status_code == 200, r.text
        return r.headers["x-powerinfer-engine"], r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    served = {}
    for engine, _ in results:
        served[engine] = served.get(engine, 0) + 1
    # least-loaded routing: a replica slowed by a loaded machine keeps its tokens in flight longer and
    # takes fewer (23 / 9 seen on a 2-core machine); each still takes a real share
    assert len(served) == 2 and min(served.values()) >= 0.2 * 32, served
    for k, (_, ids) in enumerate(results):
        greedy(prompts[k], ids, 8)
    # n=2 choices and the token endpoints go through a replica too, named in the header
    r = _complete(url, prompts[0], 4, n=2)
    r_n2 = r.headers["x-powerinfer-engine"]
    assert r.status_code == 200 and r_n2 in served
    assert len(r.json()["choices"]) == 2
    for c in r.json()["choices"]:
        greedy(prompts[0], c["token_ids"], 4)
    r = requests.post(f"{url}/detokenize", json={"tokens": [72, 105]}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["x-powerinfer-engine"] in served
    # the dashboard's metrics (the head's /metrics): each replica's tokens, node and device
    tokens = {n: 8 * c for n, c in served.items()}
    tokens[r_n2] = tokens[r_n2] + 2 * 4
    metrics_url = f"http://127.0.0.1:{cluster.head.metrics_port}/metrics"
    node_of = {r["name"]: r["node_id"] for r in _health(url)["replicas"]}

    def counted() -> dict[str, float]:
        found = {}
        for line in requests.get(metrics_url, timeout=30).text.splitlines():
            if re.match(r"ray_powerinfer_replica_generated_tokens(_total)?\{", line) and 'device="cpu"' in line:
                name = line.split('replica="')[1].split('"')[0]
                assert f'node_id="{node_of[name]}"' in line, line
                found[name] = float(line.rsplit(" ", 1)[1])
        return found

    wait_until(lambda: counted() == tokens, 60, f"the replicas' generated tokens {tokens} on /metrics")
    h = _health(url)
    assert all(r["served"] > 0 and r["tokens_in_flight"] == 0 for r in h["replicas"] if r["name"] in served)


def test_gpu_bundles_pin_one_replica_per_gpu(cluster, model_path, caplog):
    """A replica's primary executor takes its bundle's GPU: two bundles of one GPU each on the
    head's two (fake) GPUs give two different GPUs; half a GPU each gives one GPU each, and the
    replicas' config warns that they contend for it."""
    import logging

    import numpy as np

    from powerinfer_ray.actors.replicas import replica_config
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.config import EngineConfig
    from powerinfer_ray.runtime.plan import Plan

    cfg = open_model(str(model_path)).config
    plan = Plan.from_masks([np.arange(cfg.n_ff) % 2 == 0] * cfg.n_layer, None, cfg)  # a CPU executor's share
    for share in (1.0, 0.5):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="powerinfer_ray.actors.replicas"):
            ec, bundle = replica_config(EngineConfig(str(model_path), device="cuda", plan=plan, threads=1), 2, share)
        assert bundle == {"CPU": 2.0, "GPU": share} and ec.threads == 1
        assert ("share a GPU and contend" in caplog.text) is (share < 1), caplog.text

    @ray.remote(num_cpus=0)
    class Probe:
        def gpus(self) -> tuple[list, str | None]:
            return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    for share, distinct in ((1.0, 2), (0.5, None)):
        bundle = replica_bundle("cuda", threads=1, cpu_executor=False, gpus=share)
        assert bundle == {"CPU": 1.0, "GPU": share}
        pgs = [placement_group([bundle]) for _ in range(2)]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=60)
            backends = [RayBackend("probe", placement=pg) for pg in pgs]
            opts = [b.member_options("primary", "cuda", threads=1) for b in backends]
            assert [o["num_gpus"] for o in opts] == [share, share]
            probes = [Probe.options(**o).remote() for o in opts]
            seen = ray.get([p.gpus.remote() for p in probes])
            assert all(len(ids) == 1 and cvd == str(ids[0]) for ids, cvd in seen), seen
            if distinct:
                assert len({ids[0] for ids, _ in seen}) == distinct, seen
            cpu = backends[0].member_options("cpu", "cuda", threads=1)
            assert cpu["num_cpus"] == 1 and "num_gpus" not in cpu
        finally:
            for pg in pgs:
                remove_placement_group(pg)
    pg = placement_group([replica_bundle("cpu", threads=1, cpu_executor=False)])
    try:
        with pytest.raises(ValueError, match="reserves no GPU"):
            RayBackend("probe", placement=pg).member_options("primary", "cuda", threads=1)
    finally:
        remove_placement_group(pg)


def test_a_dead_node_fails_only_its_streams_and_its_replica_comes_back(url, cluster, greedy, wait_until):
    states = wait_until(lambda: (s := _states(url)) and sum(r["state"] == "up" for r in s.values()) == 2 and s, 240,
                   "two replicas up")
    node_b = cluster.nodes[1]
    (b,) = [n for n, s in states.items() if s["state"] == "up" and s["pid"] in node_b.pids()]
    (a,) = [n for n, s in states.items() if s["state"] == "up" and n != b]
    prompts = _prompts(8, seed=2, length=6)  # equal weights: the replicas take them in turn
    firsts = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, url, p, LONG, e) for p, e in zip(prompts, firsts)]
        for e in firsts:
            assert e.wait(120), "a stream sent no first token"
        node_b.kill()  # mid-stream: every stream has its first token, none is near its end
        streams = [f.result() for f in futures]
    by = {n: [s for s in streams if s["engine"] == n] for n in (a, b)}
    assert [len(by[a]), len(by[b])] == [4, 4], by
    for s in by[b]:  # the dead node's streams end with an error event naming its replica
        assert s["status"] == 200 and s["finish"] is None and 0 < len(s["ids"]) < LONG
        assert s["error"]["code"] == "engine_unavailable" and b in s["error"]["message"], s["error"]
    for s in by[a]:  # the other node's complete
        assert s["error"] is None and s["finish"] == "length" and len(s["ids"]) == LONG
    # new requests succeed, on the live replica, with the same tokens as before the node died
    for k, p in enumerate(prompts[:4]):
        r = _complete(url, p, 16)
        assert r.status_code == 200 and r.headers["x-powerinfer-engine"] == a
        greedy(p, r.json()["choices"][0]["token_ids"], 16)
    for s, p in zip(streams, prompts):
        if s["engine"] == a:
            greedy(p, s["ids"][:16], 16)
    wait_until(lambda: _states(url)[b]["state"] == "down", 60, f"{b} reported down")
    h = _health(url)
    assert h["code"] == 200 and h["status"] == "degraded"
    assert requests.get(f"{url}/v1/models", headers=AUTH, timeout=30).status_code == 200
    # the node comes back with room for two: the lost replica and the waiting one start there
    new = cluster.add(cpus=2, resources={SLOT: 2})
    states = wait_until(lambda: (s := _states(url)) and all(r["state"] == "up" for r in s.values()) and s, 300,
                   "all three replicas up")
    assert {_node_of(cluster, s["pid"]) for n, s in states.items() if n != a} == {cluster.nodes.index(new)}
    with ThreadPoolExecutor(6) as pool:
        engines = list(pool.map(lambda p: _complete(url, p, 4).headers["x-powerinfer-engine"], _prompts(6, seed=3)))
    assert set(engines) == set(states), engines


def test_the_replicas_go_away_with_the_app(url, wait_until):
    """Deleting the app stops the replicas its ingress started and removes their placement groups."""
    serve.delete("scaleout")
    for name in NAMES:
        wait_until(lambda: _gone(name), 60, f"{name} to go away with the app")
    states = {pg["name"]: pg["state"] for pg in ray.util.placement_group_table().values()}
    assert all(states[n + PLACEMENT_SUFFIX] == "REMOVED" for n in NAMES), states


def _gone(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=ENGINE_NAMESPACE)
    except ValueError:
        return True
    return False
