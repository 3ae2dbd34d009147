#!/usr/bin/env python3
"""Train an embedded tiny model from the frozen built-in corpus, reproducibly.

    PYTHONPATH=. python3 scripts/train_tiny_model.py --out OUT --predictors
    OMP_NUM_THREADS=1 PYTHONPATH=. python3 scripts/train_tiny_model.py --out OUT --ffn-act swiglu

ReGLU (the default model): the defaults are the settings of the shipped model; it was made on one
H200 in two calls: this training run, then ``--from-dense OUT/tiny-reglu.dense.gguf`` for the final
predictors, see bench/results/tiny-model-*.json.
SwiGLU (``--ffn-act swiglu``): a smaller shape and shorter run whose defaults train on a CPU in
minutes (15 on one thread of a loaded 2-core machine: on shared cores one thread is several times
faster than two); the dense file is shipped as powerinfer_ray/data/tiny-swiglu.gguf
(``powerinfer-ray sparsify`` adds thresholds), see bench/results/tiny-swiglu-train.json.

Steps: byte-level BPE vocabulary on the train split -> one training run per L1 coefficient
(in parallel processes when several are given) -> pick the sparsest run whose held-out loss is
within ``--select-tolerance`` nats of the best -> export GGUF fp16 (OUT/tiny-<act>.dense.gguf)
-> check that ReferenceModel reproduces the training model's held-out loss -> optionally
profile activations and train predictors (OUT/tiny-reglu.powerinfer.gguf).
Everything it measured goes to OUT/train_report.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from powerinfer_ray.model.tokenizer import Tokenizer
from powerinfer_ray.offline import corpus
from powerinfer_ray.offline.train_tiny import (TrainSettings, check_export, encode_stream,
                                               eval_windows, export, tiny_trained_config, train,
                                               train_tokenizer)

DENSE_FILE = "tiny-{act}.dense.gguf"
SPARSE_FILE = "tiny-reglu.powerinfer.gguf"
# defaults per FFN activation (flags left unset take these): the shipped models' settings
ACT_DEFAULTS = {
    "reglu": dict(steps=2000, batch=16, seq_len=512, lr=2e-3, warmup=100, l1=[0.0, 0.5, 2.0, 8.0],
                  n_embd=192, n_layer=6, n_ff=768, eval_windows=64),
    "swiglu": dict(steps=400, batch=16, seq_len=128, lr=3e-3, warmup=40, l1=[0.0],
                   n_embd=128, n_layer=4, n_ff=384, eval_windows=32),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--ffn-act", choices=sorted(ACT_DEFAULTS), default="reglu",
                   help="FFN activation; picks the defaults of the flags below (ACT_DEFAULTS)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--eval-windows", type=int)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--l1", type=float, nargs="+",
                   help="L1 coefficients on the FFN activations, one training run each")
    p.add_argument("--select-tolerance", type=float, default=0.02,
                   help="pick the sparsest run within this many nats of the best held-out loss")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, help="stop each training run after this long")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-ff", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sequential", action="store_true", help="train the L1 runs one after another")
    p.add_argument("--predictors", action="store_true", help="also profile and train predictors")
    p.add_argument("--predictor-tokens", type=int, default=200_000)
    p.add_argument("--max-ppl-increase", default=None, help="predictor threshold target (default: train-predictors')")
    p.add_argument("--min-top1", default=None, help="predictor threshold target (default: train-predictors')")
    p.add_argument("--magnitude-power", type=float, default=0.5,
                   help="predictor loss: weight of an active neuron ~ (its contribution) ** this")
    p.add_argument("--memory-cap-gb", type=float, default=4.0, help="predictor samples held in memory")
    p.add_argument("--from-dense", type=Path,
                   help="skip training: profile this dense GGUF and train its predictors")
    p.add_argument("--tag", default="", help="prefix of the output names (with --from-dense)")
    p.add_argument("--no-profile", action="store_true", help="skip the activation profile")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: one run -> this file
    args = p.parse_args(argv)
    for k, v in ACT_DEFAULTS[args.ffn_act].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def settings_for(args: argparse.Namespace, l1: float) -> TrainSettings:
    return TrainSettings(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                         warmup=args.warmup, dropout=args.dropout, l1=l1, eval_every=args.eval_every,
                         eval_windows=args.eval_windows, seed=args.seed, max_seconds=args.max_seconds)


def model_config(args: argparse.Namespace):  # noqa: ANN201
    return tiny_trained_config(args.ffn_act, args.vocab, args.n_embd, args.n_layer, args.n_head,
                               args.n_ff, args.seq_len)


def load_data(args: argparse.Namespace, tok_file: Path | None = None):  # noqa: ANN201
    train_docs = corpus.frozen_documents("train")
    held_docs = corpus.frozen_documents("heldout")
    if tok_file is not None and tok_file.exists():
        fields = json.loads(tok_file.read_text())
    else:
        fields = train_tokenizer(train_docs, args.vocab)
    tok = Tokenizer(fields)
    return fields, encode_stream(tok, train_docs), encode_stream(tok, held_docs)


def run_worker(args: argparse.Namespace, l1: float, tok_file: Path, out_file: Path) -> None:
    cfg = model_config(args)
    _, train_ids, held_ids = load_data(args, tok_file)
    tag = f"[l1={l1:g}] "
    res = train(cfg, train_ids, held_ids, settings_for(args, l1), args.device,
                log=lambda m: print(tag + m, flush=True))
    torch.save({"weights": res.weights, "summary": res.summary()}, out_file)


def run_all(args: argparse.Namespace, tok_file: Path, tmp: Path) -> list[dict]:
    """One training run per L1 value; returns [{l1, summary, weights}]."""
    files = [tmp / f"run_{i}.pt" for i in range(len(args.l1))]
    if args.sequential or len(args.l1) == 1:
        for l1, f in zip(args.l1, files):
            run_worker(args, l1, tok_file, f)
    else:
        base = [sys.executable, str(Path(__file__).resolve())] + [a for a in sys.argv[1:]]
        procs = [subprocess.Popen(base + ["--worker", str(f), "--l1", repr(l1)])
                 for l1, f in zip(args.l1, files)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"training runs failed with exit codes {codes}")
    runs = []
    for l1, f in zip(args.l1, files):
        blob = torch.load(f, weights_only=True)
        runs.append({"l1": l1, "summary": blob["summary"], "weights": blob["weights"]})
    return runs


def select(runs: list[dict], tolerance: float) -> dict:
    """The sparsest run whose held-out loss is within ``tolerance`` nats of the best."""
    best = min(r["summary"]["heldout_loss"] for r in runs)
    ok = [r for r in runs if r["summary"]["heldout_loss"] <= best + tolerance]
    return min(ok, key=lambda r: sum(r["summary"]["active_frac"]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args, args.l1[0], args.worker.with_name("tokenizer.json"), args.worker)
        return
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.from_dense is not None:
        report = {"command": command_line(), "device": device_name(args), "torch": torch.__version__,
                  "dense": str(args.from_dense), **make_sparse(args, args.from_dense)}
        report["seconds"] = time.time() - t0
        (args.out / f"{args.tag}predictors_report.json").write_text(json.dumps(report, indent=1) + "\n")
        return
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        fields, train_ids, held_ids = load_data(args)
        tok_file = tmp / "tokenizer.json"
        tok_file.write_text(json.dumps(fields))
        print(f"corpus: {train_ids.numel()} train tokens, {held_ids.numel()} held-out tokens, "
              f"vocabulary {len(fields['tokenizer.ggml.tokens'])}", flush=True)
        runs = run_all(args, tok_file, tmp)
    chosen = select(runs, args.select_tolerance)
    cfg = model_config(args)
    dense = export(args.out / DENSE_FILE.format(act=args.ffn_act), cfg, chosen["weights"], fields)
    windows = eval_windows(held_ids, args.seq_len)
    check = check_export(dense, windows, args.device)
    print(f"export check: reference {check['reference_loss']:.5f} vs training model "
          f"{check['training_model_loss']:.5f} (|diff| {check['abs_diff']:.2e})", flush=True)
    report = {
        "command": command_line(), "device": device_name(args),
        "torch": torch.__version__, "python": sys.version.split()[0],
        "config": {k: v for k, v in asdict(cfg).items() if k != "extra"},
        "n_params": sum(w.numel() for w in chosen["weights"].values()),
        "train_tokens": train_ids.numel(), "heldout_tokens": held_ids.numel(),
        "chosen_l1": chosen["l1"], "select_tolerance": args.select_tolerance,
        "runs": [{"l1": r["l1"], **r["summary"]} for r in runs],
        "export_check": check, "heldout_ppl_reference": math.exp(check["reference_loss"]),
    }
    report["seconds"] = time.time() - t0
    (args.out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.predictors:
        report["predictors"] = make_sparse(args, dense)
        report["seconds"] = time.time() - t0
        (args.out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"done in {report['seconds']:.0f} s: {args.out}", flush=True)


def command_line() -> str:
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    return threads + "PYTHONPATH=. python3 scripts/train_tiny_model.py " + " ".join(sys.argv[1:])


def device_name(args: argparse.Namespace) -> str:
    return torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"


def make_sparse(args: argparse.Namespace, dense: Path) -> dict:
    """Profile the dense model, train its predictors (train split), and measure their quality
    on the held-out split."""
    from powerinfer_ray.offline.predictors import FitSettings, train_predictors
    from powerinfer_ray.offline.profile import run_profile
    from powerinfer_ray.offline.quality import format_report, quality_report

    out: dict = {}
    if not args.no_profile:
        with tempfile.TemporaryDirectory() as tmp:  # keep OUT to a few files (the device tool's limit)
            stats = run_profile(dense, "builtin:train", tmp, max_tokens=args.predictor_tokens,
                                seq_len=args.seq_len, progress=False, device=args.device)
            for name in ("activation.parquet", "rank_frequency.png"):
                if (Path(tmp) / name).exists():
                    shutil.copy(Path(tmp) / name, args.out / (args.tag + name))
        out["profile"] = stats.summary()
    from powerinfer_ray.offline.thresholds import quality_target

    fit = FitSettings(magnitude_power=args.magnitude_power, seed=args.seed)
    sparse = args.out / (args.tag + SPARSE_FILE)
    result = train_predictors(dense, "builtin:train", sparse, heldout="builtin:heldout",
                              target=quality_target(args.max_ppl_increase, args.min_top1),
                              max_tokens=args.predictor_tokens, seq_len=args.seq_len, settings=fit,
                              memory_cap=int(args.memory_cap_gb * (1 << 30)), device=args.device,
                              progress=False)
    out["fit_settings"] = asdict(fit)
    out["table"] = result.to_dict()
    quality = quality_report(sparse, "builtin:heldout", seq_len=256, max_tokens=1 << 20, device=args.device)
    print(format_report(quality), flush=True)
    out["quality_heldout"] = quality
    return out


if __name__ == "__main__":
    main()
