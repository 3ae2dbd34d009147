"""The OpenAI-compatible Serve app over HTTP on 127.0.0.1 (real Serve, real engine actor on the
session's 2-CPU cluster). The same engine is reachable both ways: through the app and with
``ray.get(engine.generate.remote(...))``; greedy outputs must agree token for token (a batch
sums in another order than a request alone: there, up to rounding ties)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
import requests
import torch
from ray import serve
from ties import assert_same_up_to_ties

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.runtime.scheduler import EngineOverloaded
from powerinfer_ray.serve.app import build_app

KEY = "sk-test-key"
MODEL = "tiny-llama-gqa"  # the tiny model's general.name
ENGINE = "serve-test-engine"
N_CTX = 16384  # held generations of N_CTX - 8 tokens outlive the overload checks on busy cores
MAX_BATCH, MAX_WAITING = 8, 16
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "m.gguf", "llama-gqa", seed=5, n_layer=2, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def engine(engines, model_path):
    return engines(ENGINE, model_path, policy="dense", threads=1, max_batch=MAX_BATCH, max_waiting=MAX_WAITING,
                   n_ctx=N_CTX)


@pytest.fixture(scope="module")
def url(engine, serve_url):
    serve.run(build_app(ENGINE, api_key=KEY), name="main", route_prefix="/")  # engine by name
    serve.run(build_app(engine, max_in_flight=1), name="tight", route_prefix="/tight")  # by handle
    return serve_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _direct(engine, prompt, **kw):
    return ray.get(engine.generate.remote(prompt, **kw))


def _wait_for(engine, running: int, waiting: int, timeout=90.0) -> dict:
    """The engine's counters once it runs ``running`` and queues ``waiting`` requests (or at the
    deadline: the caller asserts)."""
    deadline = time.time() + timeout
    while True:
        st = ray.get(engine.stats.remote())["coordinator"]
        if (st["running"], st["waiting"]) == (running, waiting) or time.time() > deadline:
            return st
        time.sleep(0.05)


def _wait_idle(engine, timeout=90.0) -> dict:
    return _wait_for(engine, 0, 0, timeout)


def _assert_openai_error(r: requests.Response, status: int, param: str | None = "__any__", type_=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert err["type"] == (type_ or "invalid_request_error")
    if param != "__any__":
        assert err["param"] == param, err
    return err


def _ok(url: str) -> None:
    """The app still serves a valid request."""
    r = requests.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


# --- discovery and auth --------------------------------------------------------------------------
def test_health_and_models(url, client):
    r = requests.get(f"{url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert requests.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]["max_model_len"] == N_CTX


def test_api_key_is_enforced(url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        _assert_openai_error(requests.get(f"{url}/v1/models", headers=headers, timeout=30), 401)
        _assert_openai_error(requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30), 401)
    assert requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200


# --- generation --------------------------------------------------------------------------------
def test_greedy_completion_equals_the_engine_called_directly(engine, client):
    for prompt in ("The meaning of", [5, 17, 99, 3, 250]):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
        want = _direct(engine, prompt, max_tokens=12, temperature=0)
        choice = resp.choices[0]
        assert choice.token_ids == want["token_ids"] and choice.text == want["text"]
        assert choice.finish_reason == want["finish_reason"]
        assert resp.usage.prompt_tokens == len(want["prompt_token_ids"])
        assert resp.usage.completion_tokens == len(want["token_ids"])
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        assert resp.model == MODEL and resp.object == "text_completion"


def test_chat_completion_renders_the_plain_template(engine, client):
    # the tiny model has no chat template: "role: content" lines, then "assistant:"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    want = _direct(engine, "system: Be brief.\nuser: Hello there\nassistant:", max_tokens=10, temperature=0,
                   ignore_eos=True)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want["text"]
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 10
    assert resp.object == "chat.completion"


def test_streaming_equals_the_whole_response(client):
    kw = dict(model=MODEL, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="Once upon", **kw).choices[0].text
    chunks = list(client.completions.create(prompt="Once upon", stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []

    messages = [{"role": "user", "content": "Tell a story"}]
    whole = client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_sse_wire_format(url):
    r = requests.post(f"{url}/v1/completions", headers=AUTH, stream=True, timeout=60,
                      json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_sixteen_concurrent_requests_equal_running_them_alone(engine, client, model_path):
    prompts = [f"request {i}: " + "ab" * i for i in range(16)]
    alone = [_direct(engine, p, max_tokens=10, temperature=0) for p in prompts]

    def one(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, prompts))
    assert len({o.id for o in outs}) == 16
    ref = ReferenceModel.from_file(model_path, dtype=torch.float64)
    for want, got in zip(alone, outs):
        assert_same_up_to_ties(ref, want["prompt_token_ids"], want["token_ids"], got.choices[0].token_ids)
    assert _wait_idle(engine)["running"] == 0


# --- bad requests ----------------------------------------------------------------------------------
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ("completions", {**GOOD, "model": "gpt-4"}, "model"),
    ("completions", {**GOOD, "temperature": -0.5}, "temperature"),
    ("completions", {**GOOD, "temperature": 2.5}, "temperature"),
    ("completions", {**GOOD, "temperature": "hot"}, "temperature"),
    ("completions", {**GOOD, "top_p": 0}, "top_p"),
    ("completions", {**GOOD, "top_p": 1.5}, "top_p"),
    ("completions", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ("completions", {**GOOD, "top_k": -3}, "top_k"),
    ("completions", {**GOOD, "n": 17}, "n"),
    ("completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {**GOOD, "logprobs": 30}, "logprobs"),
    ("completions", {**GOOD, "prompt": "x" * (N_CTX + 10)}, "prompt"),  # beyond the context
    ("completions", {**GOOD, "prompt": list(range(1, 200)) * (N_CTX // 190)}, "prompt"),  # beyond, as token ids
    ("completions", {**GOOD, "prompt": [1, 2, 100000]}, "prompt"),  # outside the vocabulary
    ("completions", {**GOOD, "prompt": ["one", "two"]}, "prompt"),  # batches are not served
    ("completions", {**GOOD, "prompt": 42}, "prompt"),
    ("completions", {k: v for k, v in GOOD.items() if k != "prompt"}, "prompt"),
    ("completions", {k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ("completions", {**GOOD, "stream": "yes"}, "stream"),
    ("chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, "messages"),
    ("chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages[0]"),
    ("chat/completions", {**CHAT, "temperature": -1, "stream": True}, "temperature"),
    ("completions", "{not json", None),
    ("completions", "[1, 2, 3]", None),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_400_and_the_app_keeps_serving(url, path, body, param):
    if isinstance(body, str):
        r = requests.post(f"{url}/v1/{path}", data=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=30)
    else:
        r = requests.post(f"{url}/v1/{path}", json=body, headers=AUTH, timeout=30)
    err = _assert_openai_error(r, 400, param)
    if "context" in err["message"]:
        assert err["code"] == "context_length_exceeded"
    _ok(url)


# --- cancellation and overload -----------------------------------------------------------------------
def _open_stream(base: str, headers: dict) -> tuple[requests.Response, object]:
    """A streamed completion under way (the line iterator is returned too: dropping it closes
    the connection)."""
    r = requests.post(f"{base}/v1/completions", headers=headers, stream=True, timeout=60,
                      json={"model": MODEL, "prompt": "Hold", "max_tokens": N_CTX - 10, "temperature": 0,
                            "ignore_eos": True, "stream": True})
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    assert next(lines).startswith(b"data: {")
    return r, lines


def _counters(engine) -> dict:
    st = ray.get(engine.stats.remote())
    return {**st["coordinator"], "restarts": st["restarts"]}


def _assert_aborted_cleanly(engine, before: dict) -> None:
    """One more request aborted, its slot free, nothing failed, no executor restarted."""
    st = _wait_idle(engine)
    after = _counters(engine)
    assert st["running"] == 0 and after["aborted"] == before["aborted"] + 1
    assert after["failed"] == before["failed"] and after["restarts"] == before["restarts"]
    assert after["tokens"] - before["tokens"] < N_CTX - 10  # it did not run to its max_tokens


def test_disconnected_stream_frees_its_slot(engine, url):
    before = _counters(engine)
    r, _lines = _open_stream(url, AUTH)
    assert _counters(engine)["running"] == 1
    r.close()  # the client goes away mid-stream
    _assert_aborted_cleanly(engine, before)
    _ok(url)


def test_disconnected_plain_request_frees_its_slot(engine, url):
    before = _counters(engine)
    with pytest.raises(requests.exceptions.ReadTimeout):  # the client gives up and closes
        requests.post(f"{url}/v1/completions", headers=AUTH, timeout=(5, 0.5),
                      json={"model": MODEL, "prompt": "Hold", "max_tokens": N_CTX - 10, "ignore_eos": True})
    _assert_aborted_cleanly(engine, before)
    _ok(url)


def test_ingress_in_flight_limit_gives_429(engine, url):
    tight = f"{url}/tight"
    held, _lines = _open_stream(tight, {})  # max_in_flight=1: this one fills the ingress
    r = requests.post(f"{tight}/v1/completions", json=GOOD, timeout=30)
    err = _assert_openai_error(r, 429, type_="rate_limit_error")
    assert "in flight" in err["message"] and r.headers.get("retry-after") == "1"
    held.close()
    assert _wait_idle(engine)["running"] == 0
    deadline = time.time() + 60
    while (code := requests.post(f"{tight}/v1/completions", json=GOOD, timeout=30).status_code) == 429 \
            and time.time() < deadline:
        time.sleep(0.1)  # the ingress frees the slot once the proxy reports the disconnect
    assert code == 200


def test_full_engine_queue_gives_429(engine, url):
    # hold every slot with long generations called directly, then fill the waiting queue, each
    # time until the engine says so (states, not times: on two busy cores a step can outlast the
    # submissions, and 24 at once would find the queue full before any of them runs)
    prompt = [7, 8, 9]

    def hold(i: int) -> tuple[str, ray.ObjectRef]:
        return f"hold-{i}", engine.generate.remote(prompt_token_ids=prompt, max_tokens=N_CTX - 8, ignore_eos=True,
                                                   request_id=f"hold-{i}")

    held = [hold(i) for i in range(MAX_BATCH)]
    st = _wait_for(engine, MAX_BATCH, 0, timeout=120)
    try:
        assert (st["running"], st["waiting"]) == (MAX_BATCH, 0), st
        held += [hold(i) for i in range(MAX_BATCH, MAX_BATCH + MAX_WAITING)]
        st = _wait_for(engine, MAX_BATCH, MAX_WAITING, timeout=120)
        assert (st["running"], st["waiting"]) == (MAX_BATCH, MAX_WAITING), st
        with pytest.raises(EngineOverloaded):  # one more, called directly: rejected
            ray.get(engine.generate.remote(prompt_token_ids=prompt, max_tokens=4), timeout=60)
        r = requests.post(f"{url}/v1/completions", json=GOOD, headers=AUTH, timeout=30)
        err = _assert_openai_error(r, 429, type_="rate_limit_error")
        assert "waiting" in err["message"]
    finally:
        ray.get([engine.abort.remote(rid) for rid, _ in held])
    assert all(o["finish_reason"] == "abort" for o in ray.get([ref for _, ref in held]))
    assert _wait_idle(engine)["running"] == 0
    _ok(url)
