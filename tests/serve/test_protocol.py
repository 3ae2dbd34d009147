"""The ingress's translation between OpenAI's JSON and the engine, without Ray or HTTP: request
parsing (400s naming the field), chat templates, stream chunks, engine errors -> HTTP status."""
from __future__ import annotations

import sys

import pytest
import ray

from powerinfer_ray.runtime.scheduler import EngineError, EngineOverloaded
from powerinfer_ray.serve.app import parse_args
from powerinfer_ray.serve.chat_template import ChatTemplate
from powerinfer_ray.serve.errors import APIError, engine_error
from powerinfer_ray.serve.protocol import (parse_choices, parse_messages, parse_prompt, parse_sampling,
                                           parse_stream)
from powerinfer_ray.serve.responses import ResponseFormat

N_VOCAB = 258


OFF = dict(presence_penalty=0.0, frequency_penalty=0.0, logprobs=None)


def test_sampling_defaults_follow_openai():
    s = parse_sampling({}, default_max_tokens=16)
    assert s == dict(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=[], **OFF)


def test_sampling_fields_and_extensions():
    s = parse_sampling({"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3, "stop": "\n",
                        "ignore_eos": True, "stop_token_ids": [2], "user": "ignored", "presence_penalty": 0.5,
                        "frequency_penalty": -1, "logprobs": 3}, 16)
    assert s == dict(max_tokens=5, temperature=0.0, top_p=0.5, top_k=0, seed=3, stop=["\n"], ignore_eos=True,
                     stop_token_ids=[2], presence_penalty=0.5, frequency_penalty=-1.0, logprobs=3)


def test_chat_logprobs_are_a_flag_with_top_logprobs():
    assert parse_sampling({"logprobs": True, "top_logprobs": 4}, 8, chat=True)["logprobs"] == 4
    assert parse_sampling({"logprobs": True}, 8, chat=True)["logprobs"] == 0
    assert parse_sampling({"logprobs": False}, 8, chat=True)["logprobs"] is None
    for bad in ({"top_logprobs": 2}, {"logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(APIError) as e:
            parse_sampling(bad, 8, chat=True)
        assert e.value.param in ("logprobs", "top_logprobs")


def test_choices():
    assert parse_choices({}) == 1 and parse_choices({"n": 3, "best_of": 3}) == 3
    for bad, param in (({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 1.5}, "n"), ({"n": 2, "best_of": 4}, "best_of")):
        with pytest.raises(APIError) as e:
            parse_choices(bad)
        assert e.value.status == 400 and e.value.param == param


def test_chat_max_completion_tokens_wins_over_max_tokens():
    def max_tokens(body: dict) -> int:
        return parse_sampling(body, 100, chat=True)["max_tokens"]

    assert max_tokens({"max_completion_tokens": 7, "max_tokens": 9}) == 7
    assert max_tokens({"max_tokens": 9}) == 9 and max_tokens({}) == 100


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", "warm"), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("top_k", 1.5), ("max_tokens", 0), ("max_tokens", 2.0),
    ("max_tokens", True), ("seed", "x"), ("seed", 2**70), ("seed", -2**63 - 1), ("stop", ""), ("stop", ["a"] * 5),
    ("stop", [1]), ("stop", "\ud800"), ("logprobs", 21), ("logprobs", -1), ("presence_penalty", 2.5),
    ("frequency_penalty", "x"), ("ignore_eos", "yes"), ("stop_token_ids", "2"), ("tools", [{"type": "function"}]),
    ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 1}), ("suffix", "x"),
])
def test_bad_sampling_field_is_a_400_naming_it(field, value):
    with pytest.raises(APIError) as e:
        parse_sampling({field: value}, 16)
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


def test_lone_surrogates_are_400s_naming_the_field():
    with pytest.raises(APIError) as e:
        parse_prompt("ok \ud800", N_VOCAB)
    assert e.value.param == "prompt" and "Unicode" in e.value.message
    with pytest.raises(APIError) as e:
        parse_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "\udfff"}])
    assert e.value.param == "messages[1].content"


def test_stream_options_need_stream():
    assert parse_stream({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert parse_stream({}) == (False, False)
    with pytest.raises(APIError, match="stream_options"):
        parse_stream({"stream_options": {"include_usage": True}})


def test_prompts():
    assert parse_prompt("hi", N_VOCAB) == ("hi", None)
    assert parse_prompt([1, 2, 3], N_VOCAB) == (None, [1, 2, 3])
    assert parse_prompt(["hi"], N_VOCAB) == ("hi", None)  # a batch of one
    assert parse_prompt([[4, 5]], N_VOCAB) == (None, [4, 5])
    for bad, words in ((None, "missing"), ([], "non-empty"), (["a", "b"], "batched"), ([1, N_VOCAB], "vocabulary"),
                       ([-1], "vocabulary"), ([1, "a"], "token ids"), ({"text": "x"}, "string")):
        with pytest.raises(APIError, match=words) as e:
            parse_prompt(bad, N_VOCAB)
        assert e.value.param == "prompt"


def test_messages():
    msgs = parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": None}])
    assert msgs == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    for bad in (None, [], "hi", [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(APIError) as e:
            parse_messages(bad)
        assert e.value.status == 400 and e.value.param.startswith("messages")


# --- chat templates ------------------------------------------------------------------------------------
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2ISH = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
             "{{ raise_exception('tool messages are not supported') }}{% endif %}"
             "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}")


def test_plain_template_without_one_in_the_model():
    assert ChatTemplate(None).render(MSGS) == "system: Be brief.\nuser: Hi\nassistant:"


def test_gguf_template_is_rendered_with_jinja():
    assert ChatTemplate(CHATML).render(MSGS) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_template_bos_is_left_to_the_tokenizer():
    t = ChatTemplate(LLAMA2ISH, bos_token="<s>", eos_token="</s>", add_bos=True)
    assert t.render(MSGS) == "[system] Be brief.</s>[user] Hi</s>"  # the engine's encode adds <s>
    t = ChatTemplate(LLAMA2ISH, bos_token="<s>", eos_token="</s>", add_bos=False)
    assert t.render(MSGS).startswith("<s>[system]")


def test_template_exceptions_are_400s():
    with pytest.raises(APIError, match="tool messages are not supported") as e:
        ChatTemplate(LLAMA2ISH).render([{"role": "tool", "content": "x"}])
    assert e.value.status == 400 and e.value.param == "messages"


def test_broken_template_or_no_jinja_falls_back_to_plain(monkeypatch):
    assert ChatTemplate("{% for m in messages %}").render(MSGS).endswith("assistant:")
    for mod in ("jinja2", "jinja2.sandbox", "jinja2.exceptions"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert ChatTemplate(CHATML).render(MSGS) == "system: Be brief.\nuser: Hi\nassistant:"


# --- responses -----------------------------------------------------------------------------------------
OUT = {"text": "abc", "token_ids": [97, 98, 99], "prompt_token_ids": [256, 104], "finish_reason": "length",
       "stats": {"prompt_tokens": 2, "completion_tokens": 3}}


def test_whole_responses():
    r = ResponseFormat(False, "cmpl-1", "m").response([OUT])
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "abc"
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert "token_ids" not in r["choices"][0]
    r = ResponseFormat(True, "chatcmpl-1", "m", token_ids=True).response([OUT])
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert r["choices"][0]["token_ids"] == [97, 98, 99] and r["prompt_token_ids"] == [256, 104]


def test_n_choices_share_the_prompt_in_the_usage():
    second = {**OUT, "text": "x", "finish_reason": "stop", "stats": {"prompt_tokens": 2, "completion_tokens": 1}}
    r = ResponseFormat(False, "cmpl-1", "m").response([OUT, second])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r["choices"]] == [(0, "abc", "length"),
                                                                                   (1, "x", "stop")]
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def _entry(tok: int, text: str, lp: float | None, top: list[tuple[int, str, float]] = ()) -> dict:
    return {"token_id": tok, "token": text, "logprob": lp,
            "top": [{"token_id": i, "token": t, "logprob": v} for i, t, v in top]}


LP_OUT = {**OUT, "logprobs": [_entry(97, "a", -0.5, [(97, "a", -0.5), (120, "x", -1.5)]),
                              _entry(98, "b", -0.25, [(98, "b", -0.25), (97, "a", -2.0)]),
                              _entry(99, "c", -1.0, [(100, "d", -0.75), (99, "c", -1.0)])],
          "prompt_logprobs": [_entry(256, "<s>", None), _entry(104, "h", -3.0, [(105, "i", -0.1), (104, "h", -3.0)])]}


def test_completion_logprobs_with_and_without_echo():
    lp = ResponseFormat(False, "cmpl-1", "m", logprobs=True).response([LP_OUT])["choices"][0]["logprobs"]
    assert lp == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -0.25, -1.0],
                  "top_logprobs": [{"a": -0.5, "x": -1.5}, {"b": -0.25, "a": -2.0}, {"d": -0.75, "c": -1.0}],
                  "text_offset": [0, 1, 2]}
    choice = ResponseFormat(False, "cmpl-1", "m", logprobs=True, echo="h").response([LP_OUT])["choices"][0]
    assert choice["text"] == "habc"
    assert choice["logprobs"]["tokens"] == ["<s>", "h", "a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -0.5, -0.25, -1.0]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"i": -0.1, "h": -3.0}]


def test_chat_logprobs():
    lp = ResponseFormat(True, "chatcmpl-1", "m", logprobs=True).response([LP_OUT])["choices"][0]["logprobs"]
    assert lp["refusal"] is None and [e["token"] for e in lp["content"]] == ["a", "b", "c"]
    assert lp["content"][2] == {"token": "c", "logprob": -1.0, "bytes": [99], "top_logprobs": [
        {"token": "d", "logprob": -0.75, "bytes": [100]}, {"token": "c", "logprob": -1.0, "bytes": [99]}]}


def test_stream_chunks():
    mid = {"text": "ab", "token_ids": [97, 98], "finish_reason": None}
    last = {"text": "", "token_ids": [], "finish_reason": "stop", "stats": OUT["stats"]}
    comp = ResponseFormat(False, "cmpl-1", "m")
    assert [c["choices"][0]["text"] for c in comp.events(0, mid)] == ["ab"]
    (fin,) = comp.events(0, last)
    assert fin["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop", "text": ""}
    chat = ResponseFormat(True, "chatcmpl-1", "m")
    assert chat.events(1, {**mid, "text": ""}) == []  # nothing new to say
    (fin,) = chat.events(1, last)
    assert fin["choices"][0]["delta"] == {} and fin["choices"][0]["finish_reason"] == "stop"
    assert fin["choices"][0]["index"] == 1
    use = chat.usage_chunk(2, 3)
    assert use["choices"] == [] and use["usage"]["total_tokens"] == 5


def test_stream_echo_comes_first_with_the_prompt_logprobs():
    fmt = ResponseFormat(False, "cmpl-1", "m", logprobs=True, echo="h")
    first = {"text": "a", "token_ids": [97], "finish_reason": None, "logprobs": LP_OUT["logprobs"][:1],
             "prompt_logprobs": LP_OUT["prompt_logprobs"]}
    (c,) = fmt.events(0, first)
    assert c["choices"][0]["text"] == "ha"
    assert c["choices"][0]["logprobs"]["tokens"] == ["<s>", "h", "a"]
    (c,) = fmt.events(0, {"text": "b", "token_ids": [98], "finish_reason": None, "logprobs": LP_OUT["logprobs"][1:2]})
    assert c["choices"][0]["text"] == "b" and c["choices"][0]["logprobs"]["text_offset"] == [2]


# --- engine errors ---------------------------------------------------------------------------------------
def _remote(exc: Exception) -> Exception:
    """``exc`` as the caller of an actor method sees it."""
    return ray.exceptions.RayTaskError("generate", "Traceback ...", exc).as_instanceof_cause()


@pytest.mark.parametrize("exc,status,code,param", [
    (EngineOverloaded("300 requests are waiting (limit 256); retry later"), 429, "overloaded", None),
    (ValueError("prompt has 900 tokens; the context holds 256"), 400, "context_length_exceeded", "prompt"),
    (ValueError("max_tokens is 900, but the prompt has 3 tokens and the context holds 256: at most 253 new tokens "
                "fit; lower max_tokens (context length exceeded)"), 400, "context_length_exceeded", "max_tokens"),
    (ValueError("prompt_token_ids [5000] are outside the vocabulary [0, 1024)"), 400, None, "prompt"),
    (ValueError("temperature is -1, expected a number in [0, 100]"), 400, None, "temperature"),
    (EngineError("generation failed: executor died"), 500, "generation_failed", None),
    (ray.exceptions.RayActorError(), 503, "engine_unavailable", None),
    (ray.exceptions.ActorUnavailableError("the actor is restarting", None), 503, "engine_unavailable", None),
    (RuntimeError("boom"), 500, None, None),
])
def test_engine_errors_map_to_http(exc, status, code, param):
    for e in (exc, _remote(exc)):
        err = engine_error(e)
        assert err.status == status and err.code == code and err.param == param, (e, err.body())
    if status == 429:
        assert err.headers["Retry-After"] == "1" and err.type == "rate_limit_error"


def test_serve_config_args_are_typed():
    ec, ic, rc = parse_args({"vram_budget_gib": "16", "threads": "4", "reset_gpu_index": "true", "model": "m.gguf",
                             "max_in_flight": "8", "graphs": None, "replicas": "2", "replica_gpus": "0.5"})
    assert (ec.model, ec.vram_budget_gib, ec.threads, ec.reset_gpu_index, ec.graphs) == ("m.gguf", 16.0, 4, True, None)
    assert ic.max_in_flight == 8
    assert (rc.replicas, rc.replica_gpus, rc.replica_resource) == (2, 0.5, None)
    for bad, words in (({"threads": "four"}, "threads"), ({"threads": True}, "threads"),
                       ({"reset_gpu_index": "maybe"}, "reset_gpu_index"), ({"vram": 16}, "unknown"),
                       ({"vram_budget": 16}, "unknown"), ({"vram_budget_gib": "nan"}, "vram_budget_gib"),
                       ({"max_batch": 0}, "max_batch"), ({"max_in_flight": 0}, "max_in_flight"),
                       ({"replicas": 0}, "replicas"), ({"replica_gpus": 2}, "replica_gpus"),
                       ({"replica_resource": " "}, "replica_resource")):
        with pytest.raises(ValueError, match=words):
            parse_args({"model": "m.gguf", **bad})
