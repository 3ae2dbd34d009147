"""The rest of OpenAI's API that clients use, through the official ``openai`` client against a real
Serve app on 127.0.0.1 and a real engine (dense policy, a tiny model): log-probabilities equal to
the log-softmax of the float64 dense reference's logits, echo, n choices reproducible with a seed,
presence/frequency penalties, vLLM's /tokenize and /detokenize, X-Request-Id, usage in every
response; and hostile bodies (413, deep JSON, lone surrogates, huge seeds) answered in OpenAI's
format while the app keeps serving."""
from __future__ import annotations

import json
import socket

import numpy as np
import openai
import pytest
import ray
import requests
import torch
from ray import serve
from ties import assert_greedy

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.serve.app import build_app

MODEL = "tiny-llama-reglu"
ENGINE = "surface-test-engine"
N_CTX = 256


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("surface") / "m.gguf", "llama-reglu", seed=8, n_layer=2,
                            n_ctx=N_CTX)


@pytest.fixture(scope="module")
def ref(path):
    return ReferenceModel.from_file(path, dtype=torch.float64)


@pytest.fixture(scope="module")
def engine(engines, path):
    return engines(ENGINE, path, policy="dense", max_batch=8)


@pytest.fixture(scope="module")
def url(engine, serve_url):
    serve.run(build_app(engine, max_body_bytes=1 << 20), name="surface", route_prefix="/")
    return serve_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _log_softmax(ref: ReferenceModel, ids: list[int]) -> np.ndarray:
    """[T, V] log-probabilities of the dense reference; row t scores token t + 1."""
    return torch.log_softmax(ref.forward(ids, ref.new_cache()), -1).numpy()


def _ok(url: str) -> None:
    r = requests.post(f"{url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text


# --- log-probabilities -----------------------------------------------------------------------------
def test_completion_logprobs_equal_the_reference(engine, client, ref):
    resp = client.completions.create(model=MODEL, prompt="The meaning of", max_tokens=8, temperature=0, logprobs=5,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    prompt = resp.model_extra["prompt_token_ids"]
    lp = _log_softmax(ref, prompt + choice.token_ids)
    rows = lp[len(prompt) - 1: len(prompt) - 1 + len(choice.token_ids)]
    assert_greedy(ref, prompt, choice.token_ids)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, [r[t] for r, t in zip(rows, choice.token_ids)],
                               atol=1e-4)
    for row, top in zip(rows, choice.logprobs.top_logprobs):  # a dict by token text: some texts coincide
        assert len(top) <= 5 and max(top.values()) == pytest.approx(row.max(), abs=1e-4)
        assert all(np.min(np.abs(row - v)) < 1e-4 for v in top.values())
    assert len(choice.logprobs.tokens) == len(choice.token_ids) and choice.logprobs.text_offset[0] == 0


def test_chat_logprobs_equal_the_reference(engine, client, ref):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    prompt = resp.model_extra["prompt_token_ids"]
    rows = _log_softmax(ref, prompt + choice.token_ids)[len(prompt) - 1:][:len(choice.token_ids)]
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids)
    for row, tok, e in zip(rows, choice.token_ids, content):
        assert e.logprob == pytest.approx(row[tok], abs=1e-4)
        np.testing.assert_allclose([a.logprob for a in e.top_logprobs], np.sort(row)[::-1][:3], atol=1e-4)
        assert bytes(e.bytes) == e.token.encode()


def test_echo_returns_the_prompt_and_its_logprobs(client, ref):
    prompt = [5, 100, 101, 102, 40]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                     logprobs=1, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _log_softmax(ref, prompt + choice.token_ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], [want[i][t] for i, t in enumerate((prompt + choice.token_ids)[1:])],
                               atol=1e-4)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert choice.text.endswith(plain) and echoed.startswith("Once")


# --- n, seeds, penalties -------------------------------------------------------------------------------
def test_n_choices_with_a_seed_are_reproducible(engine, client):
    kw = dict(model=MODEL, prompt="Twice upon", max_tokens=12, temperature=1.0, seed=7, n=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    ids = [c.token_ids for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and ids == [c.token_ids for c in again.choices]
    assert ids[0] != ids[1]  # two samples, not one twice
    direct = [ray.get(engine.generate.remote("Twice upon", max_tokens=12, temperature=1.0, seed=s, ignore_eos=True))
              for s in (7, 8)]
    assert ids == [d["token_ids"] for d in direct]
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == len(direct[0]["prompt_token_ids"])
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in first.choices]


def test_chat_n_choices_stream_with_a_role_each(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, n=3, seed=1, stream=True,
                                                 extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1, 2] and sorted(finished) == [0, 1, 2]


def test_penalties_follow_openai_on_the_reference(client, ref):
    prompt, n, presence, frequency = [60, 61, 62], 12, 0.4, 1.1

    def penalized(logits: torch.Tensor, done: list[int]) -> torch.Tensor:  # OpenAI's penalties, by hand
        counts = torch.bincount(torch.tensor(done, dtype=torch.long), minlength=ref.cfg.n_vocab).double()
        return logits - frequency * counts - presence * (counts > 0).double()

    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                     presence_penalty=presence, frequency_penalty=frequency,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    got = resp.choices[0].token_ids
    assert len(got) == n and got != ref.generate_greedy(prompt, n)  # the penalties changed the output
    assert_greedy(ref, prompt, got, adjust=penalized)


# --- tokens, request ids, usage ---------------------------------------------------------------------
def test_tokenize_and_detokenize(engine, url):
    text = "Hello, tokens!"
    r = requests.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    assert r["tokens"] == ray.get(engine.encode.remote(text)) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == N_CTX
    bare = requests.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    assert bare["tokens"] == r["tokens"][1:]  # without BOS
    chat = requests.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": text}]}, timeout=30).json()
    assert chat["tokens"] == ray.get(engine.encode.remote(f"user: {text}\nassistant:"))
    back = requests.post(f"{url}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": text}
    for path, body, param in (("tokenize", {"prompt": 3}, "prompt"), ("detokenize", {"tokens": [1, 99999]}, "tokens"),
                              ("tokenize", {"prompt": "x", "model": "other"}, "model")):
        r = requests.post(f"{url}/{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_request_id_is_echoed(url):
    body = {"model": MODEL, "prompt": "id", "max_tokens": 2}
    r = requests.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "abc-123"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    r = requests.post(f"{url}/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": "s-1"},
                      timeout=30)
    assert r.headers["x-request-id"] == "s-1" and r.text.endswith("data: [DONE]\n\n")
    r = requests.post(f"{url}/v1/completions", json={**body, "temperature": 9}, headers={"X-Request-Id": "e-1"},
                      timeout=30)
    assert r.status_code == 400 and r.headers["x-request-id"] == "e-1"
    assert requests.get(f"{url}/health", timeout=30).headers["x-request-id"]  # one of its own


def test_usage_is_in_every_response(client):
    chunks = list(client.completions.create(model=MODEL, prompt="use", max_tokens=5, n=2, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)  # the last chunk carries it
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.total_tokens == 10 + chunks[-1].usage.prompt_tokens
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "u"}],
                                               max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert chat[-1].usage.completion_tokens == 3 and chat[-1].choices[0].finish_reason == "length"


# --- refused options and hostile bodies --------------------------------------------------------------
def test_unsupported_options_are_refused_by_name(client):
    msgs = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for kw, param in ((dict(tools=tools), "tools"), (dict(response_format={"type": "json_object"}), "response_format"),
                      (dict(logit_bias={"5": 3}), "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kw)
        assert e.value.body["param"] == param and param in e.value.body["message"]


def _raw(url: str, data: bytes | str) -> requests.Response:
    return requests.post(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}, timeout=60)


def test_hostile_bodies_get_openai_errors_and_the_app_keeps_serving(url):
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)})  # over this app's 1 MiB limit
    cases = [(big, 413, None), ("[" * 100_000 + "]" * 100_000, 400, None),
             ('{"model": "%s", "prompt": "a \\ud800 b"}' % MODEL, 400, "prompt"),
             (json.dumps({"model": MODEL, "prompt": "hi", "seed": 2**70}), 400, "seed"),
             (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": N_CTX}), 400, "max_tokens")]
    for data, status, param in cases:
        r = _raw(url, data)
        assert r.status_code == status, (r.status_code, r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    _ok(url)


def test_out_of_vocabulary_prompt_ids_are_refused_by_the_engine_too(engine, ref):
    """The Ray API checks ids as HTTP does: an id outside the vocabulary indexed past the
    embedding table and failed every request in flight."""
    good = [engine.generate.remote(prompt_token_ids=[9, 10 + i], max_tokens=6, ignore_eos=True) for i in range(3)]
    for bad in ([5000], [-1]):
        with pytest.raises(ray.exceptions.RayTaskError, match="outside the vocabulary"):
            ray.get(engine.generate.remote(prompt_token_ids=bad, max_tokens=2))
    for i, o in enumerate(ray.get(good)):
        assert len(o["token_ids"]) == 6
        assert_greedy(ref, [9, 10 + i], o["token_ids"])
    st = ray.get(engine.stats.remote())
    assert st["coordinator"]["failed"] == 0 and st["restarts"] == 0


def _slow_body(port: int) -> socket.socket:
    """A connection that sends its headers and then only part of its body."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /slow/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\":")
    return s


def test_slow_bodies_time_out_and_serve_never_answers_in_plain_text(engine, url):
    """More slow-body clients than the replica takes in: each gets a 408 in OpenAI's format once
    its body is late, and a good request behind them is answered by the ingress, never by Serve's
    own plain-text 429 (which a bounded Serve queue gave)."""
    serve.run(build_app(engine, max_in_flight=1, body_timeout_s=2.0), name="slow", route_prefix="/slow")
    port = int(url.rsplit(":", 1)[1])
    slow = [_slow_body(port) for _ in range(80)]  # beyond max_in_flight + the replica's reserve (64)
    try:
        r = requests.post(f"{url}/slow/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                          timeout=60)
        assert r.status_code in (200, 429), r.text
        assert "choices" in r.json() or r.json()["error"]["type"] == "rate_limit_error"
        slow[0].settimeout(30)
        head = slow[0].recv(4096).decode()
        assert head.startswith("HTTP/1.1 408") and '"code":"request_timeout"' in head.replace(" ", ""), head
    finally:
        for s in slow:
            s.close()
        serve.delete("slow")
