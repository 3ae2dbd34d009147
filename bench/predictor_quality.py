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
sweep (sparsity against quality) and its plot, ``<out>.png``. ``--allocation-of FILE`` compares
one threshold for all layers with per-layer thresholds for an equal miss of activation mass or
count; ``--safety-of FILE`` (the stdlib predictors) compares choosing the threshold on stdlib
held-out text alone with choosing it on stdlib + pydoc text, measured on vim's help.
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
MISSES = (0.1, 0.05, 0.02, 0.01, 0.003, 0.001)  # per-layer allocations: share of activations missed
GLOBALS = (1.0, 0.0, -1.0, -2.0, -3.0, -4.5)  # one threshold for all layers


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


def allocation(path: Path, docs: list[str], n_tokens: int) -> list[dict]:
    """Held-out perplexity, top-1 and sparsity of three ways to set the layers' thresholds: one
    threshold for all (what the file holds), or per layer the threshold that misses an equal
    share of each layer's activation mass or count (an option measured, not kept)."""
    import torch

    from powerinfer_ray.model import gguf_keys as K
    from powerinfer_ray.model.reference import ReferenceModel
    from powerinfer_ray.offline.quality import Evaluator, PredictorHooks
    from powerinfer_ray.offline.samples import CollectHooks, SampleStore, decode_magnitude, down_norms
    from powerinfer_ray.offline.stream import token_windows

    mf = ModelFile(path)
    cfg, ref = mf.config, ReferenceModel.from_file(mf)
    fc1 = [mf.layer(K.FC1, l, dtype=torch.float32) for l in range(cfg.n_layer)]
    fc2 = [mf.layer(K.FC2, l, dtype=torch.float32) for l in range(cfg.n_layer)]
    store = SampleStore(cfg.n_layer, cfg.n_embd, cfg.n_ff, 1 << 40)
    ev = Evaluator(ref, token_windows(Tokenizer(mf.fields), docs, 256, n_tokens, FMT),
                   CollectHooks(store, down_norms(ref)))
    curves = []  # per layer: positives' logits, highest first, with cumulative count and mass shares
    for l in range(cfg.n_layer):
        x, q = (torch.from_numpy(a) for a in store.all(l))
        logits = (torch.relu(x @ fc1[l].T) @ fc2[l].T)[q > 0]
        order = torch.argsort(logits, descending=True)
        mass = torch.cumsum(decode_magnitude(q[q > 0])[order].double(), 0)
        curves.append((logits[order], mass / mass[-1], torch.arange(1, len(order) + 1).double() / len(order)))

    def at(miss: float, kind: int) -> list[float]:  # kind 1: mass, 2: count
        out = []
        for c in curves:
            k = int(torch.searchsorted(c[kind], torch.tensor(1 - miss, dtype=torch.float64)))
            out.append(float(c[0][min(k, len(c[0]) - 1)]))
        return out

    rows = []
    for kind, level, ts in ([("global", t, [t] * cfg.n_layer) for t in GLOBALS]
                            + [("mass", m, at(m, 1)) for m in MISSES] + [("count", m, at(m, 2)) for m in MISSES]):
        h = PredictorHooks(fc1, fc2, ts)
        sc = ev.score(h)
        rows.append({"allocation": kind, "level": level, "ppl_delta_pct": 100 * (sc.ppl / ev.dense.ppl - 1),
                     "top1": sc.top1, "sparsity": 1 - sum(st["kept"] for st in h.stats(cfg.n_ff)) / cfg.n_layer,
                     "thresholds": [round(t, 3) for t in ts]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def safety(path: Path, args: argparse.Namespace) -> list[dict]:
    """The stdlib-trained predictors with the threshold chosen on held-out text that mixes in a
    shifted source (stdlib calibration documents + the pydoc held-out split), against the
    threshold chosen on stdlib alone; both measured on vim's help (shifted for both)."""
    import torch

    from powerinfer_ray.model import gguf_keys as K
    from powerinfer_ray.model.reference import ReferenceModel
    from powerinfer_ray.offline.quality import Evaluator
    from powerinfer_ray.offline.stream import token_windows
    from powerinfer_ray.offline.thresholds import QualityTarget, choose_threshold

    mf = ModelFile(path)
    tok, ref = Tokenizer(mf.fields), ReferenceModel.from_file(mf)
    fc1 = [mf.layer(K.FC1, l, dtype=torch.float32) for l in range(mf.config.n_layer)]
    fc2 = [mf.layer(K.FC2, l, dtype=torch.float32) for l in range(mf.config.n_layer)]
    calib, _ = split_docs(tok, list(iter_texts("builtin:stdlib:heldout")), args.calibration_tokens)
    pydoc = list(iter_texts("builtin:pydoc:heldout"))
    mixed = [d for pair in zip(calib, pydoc) for d in pair] + calib[len(pydoc):]
    out = []
    for name, docs in (("stdlib held-out", calib), ("stdlib + pydoc held-out", mixed)):
        ev = Evaluator(ref, token_windows(tok, docs, 256, None, FMT))
        t = choose_threshold(ev, fc1, fc2, QualityTarget()).threshold
        margin = float(mf.config.sparse_threshold) - t
        rec = evaluate(path, f"{VIM_DOCS}/*.txt (shuffled files)", vim_docs(), "shifted", "stdlib", args, margin)
        out.append({"calibrated_on": name, "threshold": t, **rec})
    return out


def run(args: argparse.Namespace) -> dict:
    tok = Tokenizer(ModelFile(trained_model_path()).fields)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False))
    out: dict = {"what": __doc__.split("\n")[0], "command": f"OMP_NUM_THREADS=1 python bench/predictor_quality.py {flags}",
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
    panels = (("ppl_delta_pct", 1, "perplexity increase over dense (%)"),
              ("top1", 100, "top-1 agreement with dense (%)"), ("kl", 1, "KL(dense || sparse), nats/token"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    for name in sorted({r["heldout"] for r in rows}):
        pts = sorted((r for r in rows if r["heldout"] == name), key=lambda r: r["sparsity"])
        label = "vim help (shifted)" if name.startswith(str(VIM_DOCS)) else "built-in held-out (in-domain)"
        for ax, (key, scale, _) in zip(axes, panels):
            ax.plot([100 * r["sparsity"] for r in pts], [scale * r[key] for r in pts], "o-", label=label)
            ax.plot([100 * r["sparsity"] for r in pts if r["margin"] == 0.0],
                    [scale * r[key] for r in pts if r["margin"] == 0.0], "k*", markersize=11)
    for ax, (_, _, ylabel) in zip(axes, panels):
        ax.set_xlabel("FFN sparsity (% of neurons skipped)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny ReGLU model, predictors trained on the built-in corpus: serve-time margins "
                 f"{', '.join(f'{m:+g}' for m in MARGINS)} (* = the threshold chosen for the default target)", fontsize=9)
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
    p.add_argument("--safety-of", default=None,
                   help="only compare calibrating this stdlib-trained file with and without shifted text")
    p.add_argument("--plot-only", action="store_true", help="redraw <out>.png from <out>.json")
    p.add_argument("--allocation-of", default=None,
                   help="only compare threshold allocations for this trained file (-> <out>.json)")
    args = p.parse_args()
    if args.allocation_of:
        tok = Tokenizer(ModelFile(trained_model_path()).fields)
        _, rest = split_docs(tok, list(iter_texts("builtin:heldout")), args.calibration_tokens)
        rows = allocation(Path(args.allocation_of), rest, args.eval_tokens)
        Path(args.out + ".json").write_text(json.dumps({"model": args.allocation_of, "heldout": "builtin:heldout "
                                                        "(after the calibration part)", "rows": rows}, indent=1))
        return
    if args.safety_of:
        Path(args.out + ".json").write_text(json.dumps({"rows": safety(Path(args.safety_of), args)}, indent=1))
        return
    out = json.loads(Path(args.out + ".json").read_text()) if args.plot_only else run(args)
    if out["margin_sweep"]:
        plot(out, args.out + ".png")


if __name__ == "__main__":
    main()
