"""User errors on the command line: one line naming what is wrong, exit status 2, found before
Ray starts (a user error used to cost Ray's start-up and a Ray traceback, or a hang)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ray

from powerinfer_ray import cli, generate
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.serve import launcher


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("cli") / "m.gguf", "llama-reglu", seed=1, n_layer=2,
                                n_ctx=64))


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Any of these commands reaching Ray's start-up is a failure of the checks."""
    def refuse(*_a, **_kw):  # noqa: ANN002, ANN003
        raise AssertionError("Ray was started before the arguments were checked")

    for module, name in ((ray, "init"), (launcher, "init_ray"), (launcher, "start_engine"), (generate, "init_ray"),
                         (generate, "start_engine")):
        monkeypatch.setattr(module, name, refuse)


def _run(argv: list[str], capsys) -> str:  # noqa: ANN001
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"powerinfer-ray {argv[0]}: error: ")
    return lines[0]


@pytest.mark.parametrize("flags,words", [
    (["--vram-budget-gib", "nan"], "vram_budget_gib=nan"),
    (["--vram-budget", "-1"], "vram_budget_gib=-1.0"),
    (["-n", "0"], "-n/--n-predict=0"),
    (["--max-batch", "0"], "max_batch=0"),
    (["-t", "0"], "threads=0"),
    (["--temperature", "-1"], "temperature is -1.0"),
    (["--seed", str(2**70)], "seed is"),
    (["--policy", "predictor"], "has no predictors"),
    (["-c", "100000"], "n_ctx=100000"),
    (["-p", "x" * 100], "prompt has 101 tokens; the context holds 64"),
    (["-n", "500"], "max_tokens is 500, but the prompt has"),
    (["--vram-budget-gib", "0.00001", "--disable-gpu-index"], "the minimum budget that works is"),
    (["--policy", "dense", "-n", "8", "--save-activation", "out"], "policy 'dense': the engine keeps activation"),
])
def test_generate_refuses_bad_arguments_in_one_line(model, capsys, flags, words):
    line = _run(["generate", "-m", model, *flags], capsys)
    assert words in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_cuda_without_a_gpu_is_refused_not_waited_for(model, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert "device='cuda': this host has no CUDA GPU" in _run(["generate", "-m", model, "--device", "cuda"], capsys)


def test_bad_model_files(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"garbage, not a model")
    assert "not a GGUF file" in _run(["generate", "-m", str(bad)], capsys)
    assert "no such file" in _run(["serve", "-m", str(tmp_path / "missing.gguf")], capsys)


@pytest.mark.parametrize("cmd", [["train-predictors", "builtin"], ["sparsify", "builtin"], ["quantize"]])
def test_an_output_file_in_a_missing_folder_is_refused_before_any_work(model, tmp_path, capsys, cmd):
    out = tmp_path / "no-such-folder" / "out.gguf"
    argv = [cmd[0], "-m", model, *cmd[1:], "-o", str(out)] if cmd[0] != "quantize" else \
        ["quantize", model, str(out), "q8_0"]
    line = _run(argv, capsys)
    assert f"the folder {out.parent} does not exist" in line, line


def test_serve_checks_its_own_flags(model, capsys):
    assert "max_in_flight=0" in _run(["serve", "-m", model, "--max-in-flight", "0"], capsys)
    assert "replicas=0" in _run(["serve", "-m", model, "--replicas", "0"], capsys)
    assert "replica_gpus=2.0" in _run(["serve", "-m", model, "--replicas", "2", "--replica-gpus", "2"], capsys)


def test_debug_shows_the_traceback(model):
    with pytest.raises(ValueError, match="max_batch=0"):
        cli.main(["--debug", "generate", "-m", model, "--max-batch", "0"])


def test_the_installed_command_prints_one_line(model):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "powerinfer_ray.cli", "generate", "-m", model, "--max-batch", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["powerinfer-ray generate: error: max_batch=0: expected an integer "
                                                ">= 1 (sequences decoded together)"]


def test_bench_lists_only_the_modes_it_has(capsys):
    from powerinfer_ray.bench import DRIVERS, MODEL_MODES

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "hybird"])
    assert e.value.code == 2 and "invalid choice: 'hybird'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert " | ".join(sorted(DRIVERS) + list(MODEL_MODES)) in " ".join(capsys.readouterr().out.split())


def test_generate_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("tokens to generate (default: 64)", "0 is greedy (the HTTP API follows OpenAI's default of 1)",
                  "--max-batch MAX_BATCH sequences decoded together (default: 8)", "--vram-budget-gib", "--policy"):
        assert words in text, words


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_budget_without_a_gpu_gets_a_note(model):
    from powerinfer_ray.runtime.config import EngineConfig
    from powerinfer_ray.runtime.preflight import prepare

    prep = prepare(EngineConfig(model, vram_budget_gib=1.0, disable_gpu_index=True))
    assert prep.device == "cpu" and prep.config.plan is not None
    assert any("without a GPU" in n and "leave it out" in n for n in prep.notes), prep.notes
    assert prepare(EngineConfig(model)).notes == ()


def test_the_first_run_says_it_compiles_the_cpu_kernel(model, tmp_path):
    """With an empty kernel cache the checks before Ray build the CPU kernel, saying so, so that
    the engine's first token does not silently pay ~10 s for the compiler."""
    code = ("from powerinfer_ray.runtime.config import EngineConfig\n"
            "from powerinfer_ray.runtime.preflight import prepare\n"
            f"prepare(EngineConfig({model!r}, device='cpu'))\n")
    env = {**os.environ, "POWERINFER_RAY_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compiling the CPU sparse-FFN kernel (once per machine)" in proc.stderr, proc.stderr
    assert list((tmp_path / "kernels").glob("*.so")), "the kernel was not built into the cache"
