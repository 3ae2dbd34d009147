"""Plot engine benchmark records (bench/results/*.json from model_bench): decode tokens/s per
mode, batch and prompt+output length, beside upstream's batch-1 figures from DESIGN.md section 3.

    python bench/plot_results.py bench/results/runtime-13b-16gib-h200.json -o bench/results/runtime-13b.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--upstream", default="PowerInfer C++=27.2,llama.cpp -ngl 27=7.0",
                    help="name=tok/s pairs drawn as reference lines (batch 1)")
    ap.add_argument("--title", default="planted Llama-2-13B, fp16, VRAM budget 16 GiB (B=batch, prompt+output)")
    a = ap.parse_args()
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
