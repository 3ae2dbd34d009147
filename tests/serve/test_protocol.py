"""The ingress's translation between OpenAI's JSON and the engine, without Ray or HTTP: request
parsing (400s naming the field), chat templates, stream chunks, engine errors -> HTTP status."""
from __future__ import annotations

import sys

import pytest
import ray

from powerinfer_ray.runtime.coordinator import EngineError, EngineOverloaded
from powerinfer_ray.serve import (APIError, ChatTemplate, ResponseFormat, engine_error, parse_args, parse_messages,
                                  parse_prompt, parse_sampling, parse_stream)

N_VOCAB = 258


def test_sampling_defaults_follow_openai():
    s = parse_sampling({}, default_max_tokens=16)
    assert s == dict(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=[])


def test_sampling_fields_and_extensions():
    s = parse_sampling({"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3, "stop": "\n",
                        "ignore_eos": True, "stop_token_ids": [2], "user": "ignored", "n": 1}, 16)
    assert s == dict(max_tokens=5, temperature=0.0, top_p=0.5, top_k=0, seed=3, stop=["\n"], ignore_eos=True,
                     stop_token_ids=[2])


def test_chat_max_completion_tokens_wins_over_max_tokens():
    def max_tokens(body: dict) -> int:
        return parse_sampling(body, 100, "max_completion_tokens")["max_tokens"]

    assert max_tokens({"max_completion_tokens": 7, "max_tokens": 9}) == 7
    assert max_tokens({"max_tokens": 9}) == 9 and max_tokens({}) == 100


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", "warm"), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("top_k", 1.5), ("max_tokens", 0), ("max_tokens", 2.0),
    ("max_tokens", True), ("seed", "x"), ("stop", ""), ("stop", ["a"] * 5), ("stop", [1]), ("n", 3),
    ("logprobs", 2), ("echo", True), ("best_of", 2), ("presence_penalty", 0.5), ("ignore_eos", "yes"),
    ("stop_token_ids", "2"),
])
def test_bad_sampling_field_is_a_400_naming_it(field, value):
    with pytest.raises(APIError) as e:
        parse_sampling({field: value}, 16)
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


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
    r = ResponseFormat(False, "cmpl-1", "m").response(OUT)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "abc"
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert "token_ids" not in r["choices"][0]
    r = ResponseFormat(True, "chatcmpl-1", "m", token_ids=True).response(OUT)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert r["choices"][0]["token_ids"] == [97, 98, 99] and r["prompt_token_ids"] == [256, 104]


def test_stream_chunks():
    mid = {"text": "ab", "token_ids": [97, 98], "finish_reason": None}
    last = {"text": "", "token_ids": [], "finish_reason": "stop", "stats": OUT["stats"]}
    comp = ResponseFormat(False, "cmpl-1", "m")
    assert [c["choices"][0]["text"] for c in comp.events(mid, False)] == ["ab"]
    (fin,) = comp.events(last, False)
    assert fin["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop", "text": ""}
    chat = ResponseFormat(True, "chatcmpl-1", "m")
    assert chat.events({**mid, "text": ""}, False) == []  # nothing new to say
    fin, use = chat.events(last, True)
    assert fin["choices"][0]["delta"] == {} and fin["choices"][0]["finish_reason"] == "stop"
    assert use["choices"] == [] and use["usage"]["total_tokens"] == 5


# --- engine errors ---------------------------------------------------------------------------------------
def _remote(exc: Exception) -> Exception:
    """``exc`` as the caller of an actor method sees it."""
    return ray.exceptions.RayTaskError("generate", "Traceback ...", exc).as_instanceof_cause()


@pytest.mark.parametrize("exc,status,code", [
    (EngineOverloaded("300 requests are waiting (limit 256); retry later"), 429, "overloaded"),
    (ValueError("prompt has 900 tokens; the context holds 256"), 400, "context_length_exceeded"),
    (ValueError("temperature is -1, expected a number in [0, 100]"), 400, None),
    (EngineError("generation failed: executor died"), 500, "generation_failed"),
    (ray.exceptions.RayActorError(), 503, "engine_unavailable"),
    (RuntimeError("boom"), 500, None),
])
def test_engine_errors_map_to_http(exc, status, code):
    for e in (exc, _remote(exc)):
        err = engine_error(e)
        assert err.status == status and err.code == code, (e, err.body())
    if status == 429:
        assert err.headers["Retry-After"] == "1" and err.type == "rate_limit_error"


def test_serve_config_args_are_typed():
    assert parse_args({"vram_budget": "16", "threads": "4", "reset_gpu_index": "true", "model": None}) == \
        {"vram_budget": 16.0, "threads": 4, "reset_gpu_index": True}
    for bad in ({"threads": "four"}, {"threads": True}, {"reset_gpu_index": "maybe"}, {"vram": 16}):
        with pytest.raises(ValueError):
            parse_args(bad)
