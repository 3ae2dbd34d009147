"""The offline commands through the CLI: quality (its dense perplexity is the reference forward's
on the same windows), train-predictors' width, share and quality flags, profile's stream flags."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn

from powerinfer_ray.cli import main
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.model.tokenizer import Tokenizer
from powerinfer_ray.offline.corpus import frozen_documents
from powerinfer_ray.offline.profile import ActivationStats, profile_activations
from powerinfer_ray.offline.stream import StreamFormat

TEXT = "\n\n".join(frozen_documents("heldout")[:12])
SEQ = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "text.txt").write_text(TEXT)
    (d / "train.txt").write_text("\n\n".join(frozen_documents("train")[:200]))
    return d, write_tiny_model(d / "dense.gguf", "llama-reglu", n_ctx=SEQ), \
        write_tiny_model(d / "sparse.gguf", "llama-reglu", n_ctx=SEQ, predictor_rank=16)


def reference_ppl(path, n_windows: int) -> float:
    """exp(mean NLL) of the reference forward over consecutive windows of the text file's
    tokens (one document, no BOS), each window scoring its last SEQ - 1 tokens."""
    ref = ReferenceModel.from_file(path)
    ids = Tokenizer(ModelFile(path).fields).encode(TEXT, add_bos=False)
    nll = 0.0
    for w in range(n_windows):
        win = torch.tensor(ids[w * SEQ:(w + 1) * SEQ])
        nll += float(Fn.cross_entropy(ref.forward(win, ref.new_cache())[:-1], win[1:], reduction="sum"))
    return math.exp(nll / (n_windows * (SEQ - 1)))


@pytest.mark.parametrize("model", ["dense", "sparse"])
def test_quality_dense_perplexity_is_the_reference_forwards(files, model, capsys):
    d, dense, sparse = files
    path = dense if model == "dense" else sparse
    out = d / f"{model}.json"
    assert main(["quality", "-m", str(path), str(d / "text.txt"), "--max-tokens", str(4 * SEQ), "--seq-len",
                 str(SEQ), "--no-window-bos", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 4 * (SEQ - 1)
    assert r["ppl_dense"] == pytest.approx(reference_ppl(path, 4), rel=1e-6)
    printed = capsys.readouterr().out
    assert f"{r['ppl_dense']:.4f}" in printed
    if model == "sparse":
        assert 0 < r["top1_agreement"] <= 1 and len(r["layers"]) == 2 and r["threshold"] == 0.0
        assert r["oracle_max_abs_logit_diff"] < 1e-4
        assert main(["quality", "-m", str(path), str(d / "text.txt"), "--max-tokens", str(4 * SEQ), "--seq-len",
                     str(SEQ), "--no-window-bos", "--margin", "0.5", "--json", str(out)]) == 0
        wide = json.loads(out.read_text())
        assert wide["threshold"] == -0.5 and wide["sparsity"] < r["sparsity"]
    else:
        assert "no predictors" in printed


def test_train_predictors_flags(files, capsys):
    d, dense, _ = files
    out, report = d / "trained.gguf", d / "trained.json"
    # the dense model's tensors are 657664 bytes (f32); a width-w predictor of both layers costs
    # 2 layers * 4 bytes * w * (64 + 256) = 2560 w: a 10 % share allows w = 25 -> 16
    args = ["train-predictors", "-m", str(dense), str(d / "train.txt"), "-o", str(out), "--heldout",
            str(d / "text.txt"), "--heldout-tokens", "512", "--max-tokens", "2048", "--seq-len", str(SEQ),
            "--max-predictor-share", "10%", "--max-ppl-increase", "2%", "--device", "cpu", "--json", str(report)]
    assert main(args) == 0
    r = json.loads(report.read_text())
    assert ModelFile(out).config.predictor_ranks == (16, 16)
    assert r["target"] == "perplexity <= dense +2 %" and r["predictor_bytes"] == 2560 * 16
    assert r["target_met"] == (r["ppl_sparse"] <= 1.02 * r["ppl_dense"])
    assert ModelFile(out).config.sparse_threshold == pytest.approx(r["threshold"], abs=1e-6)
    assert main(args[:-6] + ["--max-width", "32", "--max-predictor-share", "50%", "--recall", "0.9",
                             "--device", "cpu"]) == 0
    assert ModelFile(out).config.predictor_ranks == (32, 32)
    capsys.readouterr()
    assert main(args + ["--recall", "0.9"]) == 2
    assert "--recall chooses thresholds by recall" in capsys.readouterr().err
    assert main(args[:-2] + ["--max-predictor-share", "1%"]) == 2
    assert "max_predictor_share=0.01 allows width 2" in capsys.readouterr().err


def test_profile_stream_flags(files):
    d, dense, _ = files
    assert main(["profile", "-m", str(dense), str(d / "text.txt"), "-o", str(d / "prof"), "--max-tokens", "256",
                 "--seq-len", str(SEQ), "--doc-sep", "eos", "--window-bos"]) == 0
    got = ActivationStats.load_parquet(d / "prof" / "activation.parquet")
    want = profile_activations(dense, d / "text.txt", 256, SEQ, progress=False, fmt=StreamFormat("eos", True))
    other = profile_activations(dense, d / "text.txt", 256, SEQ, progress=False, fmt=StreamFormat("eos", False))
    np.testing.assert_array_equal(got.counts, want.counts)
    assert not np.array_equal(got.counts, other.counts)  # the flag reached the stream
