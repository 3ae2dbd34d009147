"""Load and abuse at once, against a real Serve app on 127.0.0.1 with the embedded tiny model:
64 concurrent streams, a 10 MB body, a 3 MB prompt and 32 clients that disconnect together.
Every good stream completes with the text the engine gives when called alone and never stalls
for more than a second once it started; /health answers 200 throughout; the engine's running
and waiting counts return to 0 and the 32 disconnected generations are aborted."""
from __future__ import annotations

import json
import threading
import time

import pytest
import ray
import requests
from ray import serve

from powerinfer_ray.model.default import default_model_path
from powerinfer_ray.serve.app import build_app

ENGINE = "abuse-test-engine"
N_GOOD, N_GONE, PROMPTS = 64, 32, 8
GOOD_TOKENS, GONE_TOKENS = 16, 400
STALL_S = 1.0


@pytest.fixture(scope="module")
def engine(engines):
    # 32 slots: the disconnecting clients all hold one at the moment they leave
    return engines(ENGINE, default_model_path(), max_batch=32)


@pytest.fixture(scope="module")
def url(engine, serve_url):
    serve.run(build_app(engine), name="abuse", route_prefix="/")
    return serve_url


def _events(r: requests.Response):  # noqa: ANN202
    for line in r.iter_lines():
        if line.startswith(b"data: "):
            yield line[6:]


def _good(url: str, model: str, prompt: str, start: threading.Event) -> tuple[str, float]:
    """One stream to its end: its text and its longest gap between events once it started."""
    start.wait()
    with requests.post(f"{url}/v1/completions", stream=True, timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": GOOD_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        assert r.status_code == 200, r.text
        text, gap, last = [], 0.0, None
        for data in _events(r):
            now = time.monotonic()
            gap, last = (max(gap, now - last) if last is not None else 0.0), now
            if data != b"[DONE]":
                text.append(json.loads(data)["choices"][0]["text"])
    return "".join(text), gap


def _gone(url: str, model: str, start: threading.Event, together: threading.Barrier) -> None:
    """A stream that the client drops once it is under way, at the same moment as the others."""
    start.wait()
    r = requests.post(f"{url}/v1/completions", stream=True, timeout=300, json={
        "model": model, "prompt": "Leaving soon", "max_tokens": GONE_TOKENS, "temperature": 0, "stream": True,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    next(_events(r))
    together.wait(timeout=300)
    r.close()


def _body(url: str, model: str, size: int, start: threading.Event) -> requests.Response:
    start.wait()
    body = json.dumps({"model": model, "prompt": "x" * size, "max_tokens": 4}).encode()
    return requests.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}, timeout=300)


def _health(url: str, done: threading.Event, codes: list) -> None:
    while not done.is_set():
        try:
            codes.append(requests.get(f"{url}/health", timeout=10).status_code)
        except requests.RequestException as exc:
            codes.append(repr(exc))
        time.sleep(0.2)


def _wait_idle(engine, aborted: int, timeout: float = 120.0) -> dict:  # noqa: ANN001
    deadline = time.time() + timeout
    while True:
        st = ray.get(engine.stats.remote())["coordinator"]
        if (st["running"] == st["waiting"] == 0 and st["aborted"] >= aborted) or time.time() > deadline:
            return st
        time.sleep(0.1)


def test_streams_big_bodies_and_disconnects_at_once(engine, url):
    model = ray.get(engine.model_info.remote())["name"]
    prompts = [f"Story {i}: once upon a time" for i in range(PROMPTS)]
    alone = {p: ray.get(engine.generate.remote(p, max_tokens=GOOD_TOKENS, temperature=0, ignore_eos=True))["text"]
             for p in prompts}
    before = ray.get(engine.stats.remote())["coordinator"]
    start, done, together = threading.Event(), threading.Event(), threading.Barrier(N_GONE)
    codes: list = []
    threads = {"health": [threading.Thread(target=_health, args=(url, done, codes))]}
    results: dict[str, list] = {"good": [None] * N_GOOD, "gone": [None] * N_GONE, "body": [None] * 2}

    def run(kind: str, i: int, fn, *args) -> None:  # noqa: ANN001
        try:
            results[kind][i] = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            results[kind][i] = exc

    threads["good"] = [threading.Thread(target=run, args=("good", i, _good, url, model, prompts[i % PROMPTS], start))
                       for i in range(N_GOOD)]
    threads["gone"] = [threading.Thread(target=run, args=("gone", i, _gone, url, model, start, together))
                       for i in range(N_GONE)]
    threads["body"] = [threading.Thread(target=run, args=("body", i, _body, url, model, size, start))
                       for i, size in enumerate((10 << 20, 3 << 20))]
    for t in (t for group in threads.values() for t in group):
        t.start()
    start.set()
    for t in (t for kind in ("good", "gone", "body") for t in threads[kind]):
        t.join(timeout=600)
    done.set()
    threads["health"][0].join()

    errors = [r for group in results.values() for r in group if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for i, (text, gap) in enumerate(results["good"]):
        assert text == alone[prompts[i % PROMPTS]], i
        assert gap < STALL_S, f"stream {i} stalled for {gap:.2f} s"
    too_big, too_long = results["body"]
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert codes and all(c == 200 for c in codes), [c for c in codes if c != 200][:5]
    st = _wait_idle(engine, before["aborted"] + N_GONE)
    assert st["running"] == st["waiting"] == 0 and st["aborted"] == before["aborted"] + N_GONE
    assert st["failed"] == before["failed"]
