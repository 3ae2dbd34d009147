"""serve_config.yaml: a valid Serve config whose application builder creates the engine from its
args; run here with a tiny model that carries a chat template in its GGUF metadata. The engine
it creates is reachable by name from this driver, and goes away with the app."""
from __future__ import annotations

import importlib
import socket
import time
from pathlib import Path

import openai
import pytest
import ray
import requests
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.tiny import tiny_config, tiny_weights
from powerinfer_ray.model.tokenizer import byte_level_fields
from powerinfer_ray.serve import ENGINE_NAMESPACE

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "serve-config-engine"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    cfg = tiny_config("llama-reglu", n_layer=2, n_ctx=256, name="tiny-chat")
    return write_model(tmp_path_factory.mktemp("cfg") / "chat.gguf", cfg, tiny_weights(cfg, seed=3),
                       metadata={**byte_level_fields(), K.CHAT_TEMPLATE: TEMPLATE})


def test_config_is_a_valid_serve_config_bound_to_loopback(config):
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    assert schema.http_options.host == "127.0.0.1"
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    with pytest.raises(ValueError, match="unknown serve_config args"):
        builder({**app.args, "vram": 3})


@pytest.fixture(scope="module")
def url(ray_cluster, config, chat_model):
    (app,) = config["applications"]
    module, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    args = {**app["args"], "model": str(chat_model), "policy": "dense", "threads": 1, "engine_name": ENGINE}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(builder(args), name=app["name"], route_prefix=app["route_prefix"])
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_builder_app_serves_the_chat_template_of_the_gguf(url):
    engine = ray.get_actor(ENGINE, namespace=ENGINE_NAMESPACE)  # created by the ingress replica
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True})
    # the template's {{ bos_token }} is dropped: the tokenizer adds BOS itself, once
    rendered = "<|system|>Be brief.</s>\n<|user|>Hi</s>\n<|assistant|>"
    want = ray.get(engine.generate.remote(rendered, max_tokens=8, temperature=0))
    assert resp.choices[0].message.content == want["text"]
    assert resp.choices[0].token_ids == want["token_ids"]
    assert resp.usage.prompt_tokens == len(want["prompt_token_ids"])
    assert want["prompt_token_ids"].count(want["prompt_token_ids"][0]) == 1  # a single BOS


def test_engine_goes_away_with_the_app(url):
    engine = ray.get_actor(ENGINE, namespace=ENGINE_NAMESPACE)
    executors = ray.get(engine.executor_handles.remote())
    serve.delete("powerinfer")
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            ray.get_actor(ENGINE, namespace=ENGINE_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the engine outlived its Serve app")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(executors["gpu"].stats.remote(), timeout=30)
    assert requests.get(f"{url}/health", timeout=10).status_code == 404
