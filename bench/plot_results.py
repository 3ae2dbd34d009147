"""Plot engine benchmark records (bench/results/*.json from model_bench): decode tokens/s per
mode, batch and prompt+output length, beside upstream's batch-1 figures from DESIGN.md section 3.

    python bench/plot_results.py bench/results/runtime-13b-16gib-h200-v8.json -o bench/results/runtime-13b.png

--sweeps: one panel per swept field (VRAM budget, prompt length, output length) of the batch-1
records given, decode tokens/s with the GPU share of activated neurons on each point, and a batch
panel when records of several batch sizes share one prompt + output shape:

    python bench/plot_results.py --sweeps bench/results/runtime-13b-{budgets,shapes,long}-h200.json -o sweeps.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


SWEPT = (("vram_budget_gib", "VRAM budget (GiB), prompt 64 + 128"), ("prompt_len", "prompt length"),
         ("output_len", "output length"))


def plot_sweeps(records: list[dict], out: str, title: str) -> None:
    """Decode tok/s of batch-1 records against each swept field, the other two at their most
    common values (prompt 64, output 128, budget 16 GiB in our runs)."""
    recs = [r for r in records if r["batch"] == 1]
    common = {f: max({r[f] for r in recs}, key=lambda v: sum(r[f] == v for r in recs)) for f, _ in SWEPT}
    panels = [(field, label, [r for r in recs if all(r[f] == common[f] for f, _ in SWEPT if f != field)])
              for field, label in SWEPT]
    shape = lambda r: tuple(r[f] for f, _ in SWEPT)  # noqa: E731
    multi = [shape(r) for r in records if r["batch"] > 1]
    if multi:  # batch sizes at the shape the batched runs used
        at = max(set(multi), key=multi.count)
        panels.append(("batch", f"batch size ({at[1]} + {at[2]}, {at[0]:g} GiB)",
                       [r for r in records if shape(r) == at]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.7 * len(panels), 3.6))
    for ax, (field, label, sel) in zip(axes, panels):
        pts = sorted({(r[field], r["mode"]): r for r in sel}.values(), key=lambda r: (r["mode"], r[field]))
        for mode in sorted({r["mode"] for r in pts}):
            xs = [r for r in pts if r["mode"] == mode]
            ax.plot([r[field] for r in xs], [r["decode_tok_s"] for r in xs], "o-", label=mode)
            for r in xs:
                ax.annotate(f"{r['decode_tok_s']:.1f}\n{r['gpu_activation_share']:.0%}", (r[field], r["decode_tok_s"]),
                            fontsize=7, textcoords="offset points", xytext=(0, 4), ha="center")
        if field in ("prompt_len", "batch"):
            ax.set_xscale("log", base=2 if field == "batch" else 10)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("decode tokens/s (label: tok/s, GPU share)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--upstream", default="PowerInfer C++=27.2,llama.cpp -ngl 27=7.0",
                    help="name=tok/s pairs drawn as reference lines (batch 1)")
    ap.add_argument("--title", default="planted Llama-2-13B, fp16, VRAM budget 16 GiB (B=batch, prompt+output)")
    ap.add_argument("--sweeps", action="store_true", help="panels per swept field instead of bars")
    a = ap.parse_args()
    if a.sweeps:
        recs = [r for f in a.results for r in json.loads(Path(f).read_text())["records"]]
        plot_sweeps(recs, a.out, a.title)
        return
    rows = []
    for f in a.results:
        doc = json.loads(Path(f).read_text())
        rows += [(r["mode"], f"B={r['batch']} {r['prompt_len']}+{r['output_len']}", r["decode_tok_s"], doc["commit"])
                 for r in doc["records"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{m}\n{cfg}\n({c})" for m, cfg, _, c in rows]
    bars = ax.bar(range(len(rows)), [v for _, _, v, _ in rows], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    for name_val in filter(None, a.upstream.split(",")):
        name, val = name_val.split("=")
        ax.axhline(float(val), ls="--", lw=1, color="gray")
        ax.text(len(rows) - 0.5, float(val), f" {name} {val}", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(a.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
