"""bench/offline_bench.py on the embedded tiny model, split between the primary and a CPU
executor: its records hold what the profile and train-predictors themselves wrote (the profile's
counts file, the command's JSON report, the model with predictors)."""
from __future__ import annotations

import json

import pytest

from powerinfer_ray.bench import load_driver
from powerinfer_ray.model.default import default_model_path
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.offline.profile import ActivationStats

SEQ = 64


@pytest.fixture(scope="module")
def ob():
    return load_driver("offline_bench")


@pytest.mark.slow
def test_offline_bench_records_what_the_commands_measured(ob, tmp_path):
    out, work = tmp_path / "results", tmp_path / "work"
    assert ob.main(["--vram-budget", "0.015", "--device", "cpu", "--profile-tokens", "2048", "--train-tokens", "2048",
                    "--seq-len", str(SEQ), "--train-args", "--heldout-tokens 512", "--work-dir", str(work),
                    "--out-dir", str(out), "--name", "t"]) == 0
    model = str(default_model_path())
    prof = json.loads((out / "profile-t.json").read_text())
    assert {"machine", "commit", "command", "date"} <= set(prof) and prof["command"].endswith("--name t")
    (r,) = prof["records"]
    counted = ActivationStats.load_parquet(work / "profile" / "activation.parquet")  # the profile's own file
    assert r["tokens"] == counted.n_tokens == 2048  # 32 whole windows of 64 from a corpus far longer
    assert r["active_share"] == pytest.approx(float(counted.active_fraction().mean()))
    assert r["model"] == model and r["vram_budget_gib"] == 0.015 and r["n_ctx"] == SEQ and r["device"] == "cpu"
    assert r["exchanges"] > 0 and r["cpu_busy_s"] > 0  # the CPU executor held neurons and answered
    assert 0 < r["load_s"] and 0 < r["run_s"] and r["load_s"] + r["run_s"] <= r["seconds"]
    assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert r["run_tok_s"] == pytest.approx(r["tokens"] / r["run_s"])

    pred = json.loads((out / "predictors-t.json").read_text())
    assert {"machine", "commit", "command", "date"} <= set(pred)
    (p,) = pred["records"]
    report = json.loads((work / "predictors-report.json").read_text())  # train-predictors --json
    trained = ModelFile(work / "tiny-reglu.predictors.gguf").config
    assert p["layers"] == len(report["layers"]) == len(trained.predictor_ranks) == ModelFile(model).config.n_layer
    assert p["min_recall"] == min(layer["recall"] for layer in report["layers"]) and 0.5 < p["min_recall"] <= 1
    assert p["tokens"] == report["n_train_tokens"] > 0 and p["tokens"] % SEQ == 0
    assert p["model"] == model and p["vram_budget_gib"] == 0.015 and p["report"] == report
    assert report["seconds"] <= p["seconds"] and p["minutes"] == pytest.approx(p["seconds"] / 60)
    assert "--engine --vram-budget-gib 0.015 --device cpu --n-ctx 64" in p["cli"]


@pytest.mark.parametrize("argv, words", [
    (["-m", "planted:tiny?layers=2"], "train-predictors reads a GGUF file; add --as-file DIR"),
    (["--phases", "profile,quality"], "--phases 'profile,quality': expected a comma-separated list of profile, train"),
])
def test_offline_bench_refuses_before_running(ob, tmp_path, argv, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        ob.main([*argv, "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())
