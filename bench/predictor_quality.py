#!/usr/bin/env python3
"""Predictor quality in and off the training domain, on the embedded tiny model (CPU is enough).

    OMP_NUM_THREADS=1 python bench/predictor_quality.py --out bench/results/predictor-quality-tiny-cpu

Scenarios (each trains predictors on the dense weights of the embedded model with the default
settings of ``train-predictors``, choosing the threshold on a held-out part of the built-in
corpus's held-out split, then measures other text at that threshold):

- ``mixed``: predictors trained on the built-in corpus (pydoc topics + stdlib docstrings);
- ``stdlib``: trained on the stdlib docstrings alone, so the pydoc topics are shifted text;
- ``mixed-share10``: as ``mixed`` with predictors capped at 10 % of the model's bytes.

Evaluation sets: ``in`` = the rest of the held-out split (of the same sources as the training
corpus), ``shifted`` = the pydoc topics (``stdlib`` only) and vim's help files (a source the
model itself never saw; /usr/share/vim/vim90/doc when present). Records: model, predictors,
heldout, domain, ppl_delta_pct, top1, sparsity, kl, margin, threshold. Also writes a margin
sweep (sparsity against quality) and its plot, ``<out>.png``.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.tokenizer import Tokenizer
from powerinfer_ray.offline.corpus import iter_texts
from powerinfer_ray.offline.predictors import train_predictors
from powerinfer_ray.offline.quality import quality_report
from powerinfer_ray.offline.stream import StreamFormat, stream_array
from powerinfer_ray.offline.train_tiny import trained_model_path

FMT = StreamFormat("bos", window_bos=False)  # how the embedded model was trained
VIM_DOCS = Path("/usr/share/vim/vim90/doc")
SCENARIOS = {"mixed": ("builtin:train", None), "stdlib": ("builtin:stdlib:train", "stdlib"),
             "mixed-share10": ("builtin:train", None)}
MARGINS = (-1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0)


def split_docs(tok: Tokenizer, docs: list[str], n_tokens: int) -> tuple[list[str], list[str]]:
    """(the first documents, at least ``n_tokens`` tokens; the rest)."""
    for k in range(1, len(docs) + 1):
        if len(stream_array(tok, docs[:k], FMT.resolve(tok), n_tokens)[0]) >= n_tokens:
            return docs[:k], docs[k:]
    raise ValueError(f"the documents hold fewer than {n_tokens} tokens")


def vim_docs() -> list[str]:
    files = sorted(VIM_DOCS.glob("*.txt"))
    random.Random(0).shuffle(files)  # a prefix samples many files
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def evaluate(path: Path, name: str, docs: list[str], domain: str, scenario: str, args: argparse.Namespace,
             margin: float = 0.0) -> dict:
    r = quality_report(path, docs, seq_len=256, max_tokens=args.eval_tokens, fmt=FMT, margin=margin, oracle=False)
    rec = {"model": "powerinfer-ray-tiny-reglu", "predictors": scenario, "heldout": name, "domain": domain,
           "tokens": r["tokens"], "ppl_dense": r["ppl_dense"], "ppl_sparse": r["ppl_sparse"],
           "ppl_delta_pct": 100 * (r["ppl_ratio"] - 1), "top1": r["top1_agreement"], "kl": r["kl"],
           "sparsity": r["sparsity"], "margin": margin, "threshold": r["threshold"],
           "recall_per_layer": [round(s["recall"], 4) for s in r["layers"]]}
    print(json.dumps({k: v for k, v in rec.items() if k != "recall_per_layer"}), flush=True)
    return rec


def run(args: argparse.Namespace) -> dict:
    tok = Tokenizer(ModelFile(trained_model_path()).fields)
    out: dict = {"what": __doc__.split("\n")[0], "command": "OMP_NUM_THREADS=1 python bench/predictor_quality.py "
                 + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "scenarios"),
                 "train_tokens": args.train_tokens, "calibration_tokens": args.calibration_tokens,
                 "eval_tokens": args.eval_tokens, "runs": [], "records": [], "margin_sweep": []}
    for scenario in args.scenarios.split(","):
        corpus, source = SCENARIOS[scenario]
        calib, rest = split_docs(tok, list(iter_texts(f"builtin:{source}:heldout" if source else "builtin:heldout")),
                                 args.calibration_tokens)
        path = Path(f"{args.workdir}/tiny-{scenario}.powerinfer.gguf")
        t0 = time.time()
        res = train_predictors(trained_model_path(), corpus, path, heldout=calib, max_tokens=args.train_tokens,
                               heldout_tokens=args.calibration_tokens, fmt=FMT, device="cpu", progress=False,
                               max_predictor_share=0.1 if scenario.endswith("share10") else 0.2)
        out["runs"].append({"scenario": scenario, "corpus": corpus, "seconds": time.time() - t0,
                            "result": res.to_dict()})
        sets = [(f"builtin:{source or 'all'}:heldout (after the calibration part)", rest, "in")]
        if source == "stdlib":
            sets.append(("builtin:pydoc:train", list(iter_texts("builtin:pydoc:train")), "shifted"))
        if VIM_DOCS.exists():
            sets.append((f"{VIM_DOCS}/*.txt (shuffled files)", vim_docs(), "shifted"))
        for name, docs, domain in sets:
            out["records"].append(evaluate(path, name, docs, domain, scenario, args))
            if scenario == "mixed":
                out["margin_sweep"] += [evaluate(path, name, docs, domain, scenario, args, m) for m in MARGINS if m]
        Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["margin_sweep"] + [r for r in out["records"] if r["predictors"] == "mixed"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for name in sorted({r["heldout"] for r in rows}):
        pts = sorted((r for r in rows if r["heldout"] == name), key=lambda r: r["sparsity"])
        label = name.split(" ")[0].replace("/usr/share/vim/vim90/doc/*.txt", "vim help (shifted)")
        for ax, key in zip(axes, ("ppl_delta_pct", "top1")):
            ax.plot([100 * r["sparsity"] for r in pts], [r[key] * (1 if key != "top1" else 100) for r in pts],
                    "o-", label=label)
            for r in pts:
                if r["margin"] == 0.0:
                    ax.plot(100 * r["sparsity"], r[key] * (1 if key != "top1" else 100), "k*", markersize=10)
    axes[0].set_ylabel("perplexity increase over dense (%)")
    axes[1].set_ylabel("top-1 agreement with dense (%)")
    for ax in axes:
        ax.set_xlabel("FFN sparsity (% of neurons skipped)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny ReGLU model, predictors trained on the built-in corpus: serve-time margin sweep "
                 "(* = default threshold)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output path without extension (.json, .png)")
    p.add_argument("--scenarios", default="mixed,stdlib,mixed-share10")
    p.add_argument("--train-tokens", type=int, default=100_000)
    p.add_argument("--calibration-tokens", type=int, default=8192)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--workdir", default="/tmp")
    args = p.parse_args()
    out = run(args)
    if out["margin_sweep"]:
        plot(out, args.out + ".png")


if __name__ == "__main__":
    main()
