"""The engine's configuration as data: frozen, checked when built (a message naming the field, the
value and what is expected), and the one source of the CLI's flags and Serve's arguments."""
from __future__ import annotations

import dataclasses
import math

import pytest

from powerinfer_ray.cli import build_parser
from powerinfer_ray.model.default import DATA_DIR
from powerinfer_ray.runtime.config import (EngineConfig, ExecutorConfig, PlanConfig, SchedulerConfig, coerce,
                                           exposed_fields, split_cache_path)
from powerinfer_ray.serve.app import parse_args
from powerinfer_ray.serve.config import IngressConfig, ReplicaConfig


@pytest.mark.parametrize("field,value,words", [
    ("vram_budget_gib", math.nan, "vram_budget_gib=nan: expected a finite number > 0"),
    ("vram_budget_gib", -1.0, "vram_budget_gib=-1.0"), ("vram_budget_gib", 0, "vram_budget_gib=0"),
    ("vram_budget_gib", math.inf, "vram_budget_gib=inf"), ("max_batch", 0, "max_batch=0: expected an integer >= 1"),
    ("max_batch", 2.5, "max_batch=2.5"), ("n_ctx", 1, "n_ctx=1"), ("threads", 0, "threads=0"),
    ("device", "gpu", "device='gpu': expected one of cuda, cpu"), ("policy", "sparse", "policy='sparse'"),
    ("dtype", "f8", "dtype='f8'"), ("method", "lp", "method='lp'"), ("gpu_fraction", 1.5, "gpu_fraction=1.5"),
    ("prefill_chunk", 0, "prefill_chunk=0"), ("timeout_s", 0, "timeout_s=0"), ("graphs", "yes", "graphs='yes'"),
    ("max_waiting", -1, "max_waiting=-1"), ("cpu_groups", -1, "cpu_groups=-1"), ("plan", "x", "plan='str'"),
    ("zero_copy", 1.5, "zero_copy=1.5: expected a finite number [0, 1]"), ("zero_copy", -0.1, "zero_copy=-0.1"),
])
def test_bad_values_are_refused_naming_the_field(field, value, words):
    with pytest.raises(ValueError) as e:
        EngineConfig("m.gguf", **{field: value})
    assert str(e.value).startswith(words), str(e.value)


def test_configs_are_frozen_and_split_in_parts():
    ec = EngineConfig("m.gguf", vram_budget_gib=1.5, threads=3, max_batch=4, policy="dense")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ec.max_batch = 0
    assert ec.vram_budget_bytes == 3 << 29
    assert ec.part(SchedulerConfig) == SchedulerConfig(max_batch=4)
    assert ec.part(ExecutorConfig) == ExecutorConfig(threads=3, policy="dense")
    assert ec.part(PlanConfig).vram_budget_gib == 1.5
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert names[0] == "model" and len(names) == len(set(names)) == 1 + sum(
        len(dataclasses.fields(c)) for c in (PlanConfig, ExecutorConfig, SchedulerConfig))


def test_unknown_options_suggest_the_known_name():
    with pytest.raises(ValueError, match="unknown engine option 'vram_budget'; did you mean 'vram_budget_gib'"):
        EngineConfig.from_options("m.gguf", vram_budget=16)
    with pytest.raises(ValueError, match="unknown engine option 'max_ongoing'"):
        EngineConfig.from_options("m.gguf", max_ongoing=3)


def test_text_values_are_converted_by_the_fields_kind():
    assert coerce(EngineConfig, "vram_budget_gib", "2.5") == 2.5 and coerce(EngineConfig, "vram_budget_gib", 2) == 2.0
    assert coerce(EngineConfig, "threads", "4") == 4 and coerce(EngineConfig, "graphs", "false") is False
    assert coerce(EngineConfig, "device", "cpu") == "cpu" and coerce(EngineConfig, "n_ctx", None) is None
    for name, value in (("threads", "4.5"), ("threads", True), ("graphs", "maybe"), ("max_batch", 2.0)):
        with pytest.raises(ValueError, match=name):
            coerce(EngineConfig, name, value)


def _cli_config(argv: list[str]) -> EngineConfig:
    a = build_parser().parse_args(["generate", *argv])
    return EngineConfig("m.gguf", **{f.name: getattr(a, f.name) for f in exposed_fields(EngineConfig)})


def test_cli_flags_are_the_config_fields():
    """Every exposed field is a flag named after it; llama.cpp's spellings are aliases; defaults
    are the fields' defaults."""
    assert _cli_config([]) == EngineConfig("m.gguf")
    got = _cli_config(["--vram-budget-gib", "2", "-t", "3", "--no-graphs", "-c", "128", "--max-batch", "4",
                       "--policy", "dense", "--max-waiting", "9", "--reset-gpu-index", "--dtype", "bf16"])
    assert got == EngineConfig("m.gguf", vram_budget_gib=2.0, threads=3, graphs=False, n_ctx=128, max_batch=4,
                               policy="dense", max_waiting=9, reset_gpu_index=True, dtype="bf16")
    assert _cli_config(["--vram-budget", "2", "--ctx-size", "64", "--graphs"]) == \
        EngineConfig("m.gguf", vram_budget_gib=2.0, n_ctx=64, graphs=True)
    serve = build_parser().parse_args(["serve", "--max-in-flight", "3", "--api-key", "k", "--replicas", "2",
                                       "--replica-gpus", "0.5", "--replica-resource", "slot"])
    assert IngressConfig(**{f.name: getattr(serve, f.name) for f in dataclasses.fields(IngressConfig)}) == \
        IngressConfig(max_in_flight=3, api_key="k")
    assert ReplicaConfig(**{f.name: getattr(serve, f.name) for f in dataclasses.fields(ReplicaConfig)}) == \
        ReplicaConfig(replicas=2, replica_gpus=0.5, replica_resource="slot")


def test_serve_args_are_the_same_names():
    every = {f.name: f.default for f in exposed_fields(EngineConfig)}
    every.update({f.name: f.default for cls in (IngressConfig, ReplicaConfig) for f in dataclasses.fields(cls)})
    ec, ic, rc = parse_args({"model": "m.gguf", **every, "api_key": "k"})
    assert ec == EngineConfig("m.gguf") and ic == IngressConfig(api_key="k") and rc == ReplicaConfig()


def test_split_cache_of_the_packaged_model_goes_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_RAY_CACHE", str(tmp_path / "cache"))
    packaged = split_cache_path(str(DATA_DIR / "tiny-reglu.powerinfer.gguf"))
    assert packaged.parent == tmp_path / "cache" and packaged.parent.is_dir()
    assert split_cache_path(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf.generated.gpuidx"
