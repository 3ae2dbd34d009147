#!/usr/bin/env python3
"""What Q8_0 and Q4_0 cost in quality, on the embedded tiny model (f16) and its held-out text.

    PYTHONPATH=. python3 bench/quant_quality.py [--max-tokens N] [--sparse-tokens N] [-o bench/results]

The f16 file is quantized with ``powerinfer-ray quantize`` (``offline.quantize.quantize_file``);
each quantized file's dense forward (the reference over the dequantized weights) is compared with
the f16 file's on the held-out split: perplexity of both and top-1 agreement of the next-token
argmax. The predictors' quality on each file (``offline.quality.quality_report``: sparse vs its
own dense) is reported beside it. Writes bench/results/quant-quality-tiny.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import write_results  # noqa: E402

from powerinfer_ray.model.default import default_model_path  # noqa: E402
from powerinfer_ray.offline.quality import quality_report  # noqa: E402
from powerinfer_ray.offline.quantize import quantization_quality, quantize_file  # noqa: E402


def sparse_summary(path: Path, max_tokens: int) -> dict:
    r = quality_report(path, "builtin:heldout", seq_len=256, max_tokens=max_tokens)
    layers = r["layers"]
    return {"tokens": r["tokens"], "ppl_dense": r["ppl_dense"], "ppl_sparse": r["ppl_sparse"],
            "ppl_ratio": r["ppl_ratio"], "top1_agreement": r["top1_agreement"],
            "mean_recall": sum(s["recall"] for s in layers) / len(layers),
            "mean_kept": sum(s["kept"] for s in layers) / len(layers)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=None, help="held-out tokens (default: all of them)")
    ap.add_argument("--sparse-tokens", type=int, default=4096, help="tokens of each predictor quality report")
    ap.add_argument("-o", "--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    src = default_model_path()
    records = {"f16": {"file_bytes": src.stat().st_size, "predictors": sparse_summary(src, a.sparse_tokens)}}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in ("q8_0", "q4_0"):
            t0 = time.perf_counter()
            out = quantize_file(src, Path(tmp) / f"tiny-reglu.{qtype}.powerinfer.gguf", qtype, progress=False)
            seconds = time.perf_counter() - t0
            q = quantization_quality(src, out, "builtin:heldout", seq_len=256, max_tokens=a.max_tokens)
            records[qtype] = {"file_bytes": out.stat().st_size, "quantize_seconds": round(seconds, 2),
                              "vs_f16": q, "predictors": sparse_summary(out, a.sparse_tokens)}
            print(qtype, records[qtype])
    write_results(a.out_dir, "quant-quality-tiny", " ".join(["python3", "bench/quant_quality.py", *sys.argv[1:]]),
                  what="dense quality of the embedded tiny model quantized to Q8_0 / Q4_0 vs its f16 file, "
                       "held-out split; and each file's predictors (sparse vs its own dense)",
                  model=str(src.name), results=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
