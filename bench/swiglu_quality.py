"""Quality of training-free SwiGLU thresholds on the tiny SwiGLU model's held-out text.

    OMP_NUM_THREADS=1 python bench/swiglu_quality.py            # -> bench/results/swiglu-quality-tiny.{json,png}

For each criterion (|SiLU(gate)|: the gate-first semantics; |h|: for comparison) and each target
sparsity, thresholds are calibrated on the train split (``offline.sparsify.calibrate``) and the
thresholded dense forward is compared with the dense one on held-out windows: perplexity, top-1
agreement of the next-token argmax, the sparsity reached per layer, and the share of FFN weight
rows a gate-first device reads (gate: all gate rows + up/down rows of active neurons; h: gate and
up rows of all neurons + down rows of active ones).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the drivers share model_bench's helpers
from model_bench import commit, machine  # noqa: E402

from powerinfer_ray.model.gguf_file import ModelFile  # noqa: E402
from powerinfer_ray.model.reference import ReferenceModel  # noqa: E402
from powerinfer_ray.model.tokenizer import Tokenizer  # noqa: E402
from powerinfer_ray.offline.sparsify import (calibrate, calibration_windows, target_per_layer,  # noqa: E402
                                             threshold_quality)
from powerinfer_ray.offline.train_tiny import trained_swiglu_path  # noqa: E402

TARGETS = (0.0, 0.3, 0.4, 0.5, 0.6)
BAR = {0.4: 0.015}  # target sparsity -> largest perplexity increase allowed (issue 20)


def rows_read(on: str, sparsity: float) -> float:
    """Share of a layer's FFN weight rows (gate + up + down) a gate-first device reads."""
    return (1 + 2 * (1 - sparsity)) / 3 if on == "gate" else (2 + (1 - sparsity)) / 3


def run(args: argparse.Namespace) -> dict[str, Any]:
    mf = ModelFile(args.model)
    tok = Tokenizer(mf.fields)
    seq = mf.config.n_ctx
    calib = calibration_windows(tok, "builtin:train", args.calib_tokens, seq)
    held = calibration_windows(tok, "builtin:heldout", args.eval_tokens + args.eval_tokens // seq, seq + 1)
    ref = ReferenceModel.from_file(mf, thresholded=False)
    records = []
    for on in ("gate", "h"):
        for s in TARGETS:
            t0 = time.time()
            values = calibrate(ref, calib, target_per_layer(s, mf.config.n_layer), on)
            q = threshold_quality(ref, held, values, on)
            sp = float(np.mean(q["sparsity"]))
            records.append({"criterion": on, "target_sparsity": s, "thresholds": list(values), **q,
                            "mean_sparsity": sp, "ffn_rows_read": rows_read(on, sp),
                            "seconds": round(time.time() - t0, 1)})
            print(f"{on:>4} target {s:.1f}: sparsity {sp:.3f}, ppl {q['ppl']:.3f} vs {q['ppl_dense']:.3f} "
                  f"({100 * q['ppl_increase']:+.2f} %), top-1 {100 * q['top1_agreement']:.2f} %", flush=True)
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    gate_at = {r["target_sparsity"]: r for r in records if r["criterion"] == "gate"}
    bars = {f"gate_first_{s}": {"ppl_increase": gate_at[s]["ppl_increase"], "max": m,
                                "met": gate_at[s]["ppl_increase"] <= m} for s, m in BAR.items()}
    return {"what": "SwiGLU threshold quality, thresholded dense forward vs dense (reference path)",
            "model": str(Path(args.model).relative_to(ROOT)) if Path(args.model).is_relative_to(ROOT) else args.model,
            "calibration": f"builtin:train, {sum(map(len, calib))} tokens in windows of {seq}",
            "evaluation": f"builtin:heldout, {records[0]['tokens']} tokens in windows of {seq}",
            "machine": machine(), "commit": commit(), "command": threads + "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d"), "bars": bars, "records": records}


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for on, style in (("gate", "o-"), ("h", "s--")):
        rs = [r for r in result["records"] if r["criterion"] == on]
        label = "|SiLU(gate)| (gate-first)" if on == "gate" else "|h|"
        axes[0].plot([r["target_sparsity"] for r in rs], [100 * r["ppl_increase"] for r in rs], style, label=label)
        axes[1].plot([r["target_sparsity"] for r in rs], [100 * r["top1_agreement"] for r in rs], style, label=label)
        axes[2].plot([100 * r["ffn_rows_read"] for r in rs], [100 * r["ppl_increase"] for r in rs], style, label=label)
    for s, m in BAR.items():
        axes[0].plot([s], [100 * m], "r_", markersize=14, label=f"bar at {s}: +{100 * m:.1f} %")
    axes[0].set(xlabel="target sparsity", ylabel="perplexity increase over dense (%)")
    axes[1].set(xlabel="target sparsity", ylabel="top-1 agreement with dense (%)")
    axes[2].set(xlabel="FFN weight rows read, gate-first (%)", ylabel="perplexity increase (%)")
    axes[2].invert_xaxis()
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']}: {result['evaluation']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(trained_swiglu_path()))
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("-o", "--out", default=str(ROOT / "bench/results/swiglu-quality-tiny.json"))
    args = p.parse_args()
    result = run(args)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
