"""A dead engine is replaced: after kill -9 of the engine actor's process, Ray restarts it under
the same name and handle, the Serve app answers again, and the shared-memory channel of the dead
engine's executors is removed."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import ray
import requests
from ray import serve
from ties import assert_greedy

from powerinfer_ray.actors.coordinator import Coordinator
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.serve.app import build_app


def _health(url: str) -> int:
    try:
        return requests.get(f"{url}/health", timeout=15).status_code
    except requests.RequestException:
        return 0


def test_a_killed_engine_is_replaced_and_its_channel_removed(ray_cluster, serve_url, tmp_path, wait_until):
    path = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=4, n_layer=2, n_ctx=128)
    ref = ReferenceModel.from_file(path)
    # half the neurons on a CPU executor: the engine has a shared-memory channel
    engine = Coordinator.options(name="restart-engine", max_concurrency=1000).remote(
        str(path), policy="dense", gpu_fraction=0.5, threads=1)
    try:
        old_pid = ray.get(engine.ready.remote())["pid"]
        channel = Path(ray.get(engine.__ray_call__.remote(lambda self: str(self.group.channel.path))))
        assert channel.exists()
        serve.run(build_app(engine), name="restart", route_prefix="/")
        url = serve_url
        assert _health(url) == 200

        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: _health(url) != 200, 60, "the app to notice the dead engine")
        wait_until(lambda: _health(url) == 200, 180, "the restarted engine")
        assert ray.get(engine.ready.remote())["pid"] != old_pid
        r = requests.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-llama-reglu", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6
        assert_greedy(ref, [5, 6, 7], r.json()["choices"][0]["token_ids"])
        wait_until(lambda: not channel.exists(), 60, f"{channel} of the dead executors to be removed")
    finally:
        serve.delete("restart")
        ray.kill(engine, no_restart=True)
