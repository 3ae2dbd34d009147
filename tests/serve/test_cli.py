"""``powerinfer-ray serve`` as a user runs it: its own local Ray, the engine (or two replicas of
it), the app on 127.0.0.1, a banner with the URL once the app answers, a clean exit on Ctrl-C or
SIGTERM."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
import requests

from powerinfer_ray.model.tiny import write_tiny_model


@pytest.mark.parametrize("sig,replicas", [(signal.SIGINT, 1), (signal.SIGTERM, 2)], ids=["ctrl-c", "sigterm-2"])
def test_serve_cli_serves_until_interrupted(tmp_path, sig, replicas, free_port, serve_process):
    """Ctrl-C and SIGTERM (kill, docker stop) both end in the same clean stop: each step printed,
    exit status 0. With --replicas 2 both replicas (one CPU each, on the local node) serve in turn."""
    model = write_tiny_model(tmp_path / "m.gguf", "llama-reglu", seed=2, n_layer=2, n_ctx=128)
    port = free_port()
    server = serve_process(["-m", str(model), "--port", str(port), "--device", "cpu", "-t", "1", "--api-key",
                            "sk-cli", "--replicas", str(replicas)], cwd=str(tmp_path), timeout=120)
    proc, lines, url = server.proc, server.lines, server.url
    try:
        assert url == f"http://127.0.0.1:{port}"
        auth = {"Authorization": "Bearer sk-cli"}
        assert requests.get(f"{url}/v1/models", timeout=30).status_code == 401
        model_id = requests.get(f"{url}/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
        names = ["powerinfer-engine"] if replicas == 1 else ["powerinfer-engine-0", "powerinfer-engine-1"]
        deadline = time.time() + 120
        while [r["state"] for r in requests.get(f"{url}/health", timeout=30).json()["replicas"]] != ["up"] * replicas:
            assert time.time() < deadline, "the replicas did not all come up"
            time.sleep(0.5)
        served = set()
        for _ in range(replicas):
            r = requests.post(f"{url}/v1/completions", headers=auth, timeout=60,
                              json={"model": model_id, "prompt": "Hi", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            served.add(r.headers["x-powerinfer-engine"])
        assert sorted(served) == names
        proc.send_signal(sig)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"no exit within 90 s of {sig.name}; its last lines:\n" + "".join(lines[-30:])) from None
        server.drain.join(timeout=10)  # the last lines, up to EOF
        assert rc == 0, "".join(lines[-30:])
        assert any(line.startswith("stopped (") for line in lines), "".join(lines[-30:])
    finally:
        server.stop()
