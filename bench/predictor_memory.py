#!/usr/bin/env python3
"""Peak memory of train-predictors against the corpus size (the samples spill to disk beyond
the memory cap, so the peak should not follow the samples), on the embedded tiny model.

    OMP_NUM_THREADS=1 python bench/predictor_memory.py --tokens 25000,200000 --out bench/results/predictors-memory-tiny-cpu.json

Each size runs in a fresh process (ru_maxrss is a process-lifetime peak)."""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def one(tokens: int) -> dict:
    from powerinfer_ray.offline.predictors import train_predictors
    from powerinfer_ray.offline.train_tiny import trained_model_path

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        r = train_predictors(trained_model_path(), "builtin:train", f"{tmp}/m.gguf", heldout="builtin:heldout",
                             max_tokens=tokens, device="cpu", progress=False, per_layer=False, log=lambda m: None)
    cfg_row = 6 * (192 * 4 + 768)  # bytes of samples per token: 6 layers of x [192] f32 + codes [768]
    return {"model": "powerinfer-ray-tiny-reglu", "tokens": r.n_train_tokens, "seconds": round(time.time() - t0, 1),
            "samples_mib": round(r.n_train_tokens * cfg_row / 2**20, 1), "memory_cap_mib": 256,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "sparsity": r.sparsity, "top1": r.top1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="25000,200000")
    p.add_argument("--out", default=None)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one)))
        return
    rows = [json.loads(subprocess.run([sys.executable, __file__, "--one", t], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]) for t in a.tokens.split(",")]
    out = {"what": "train-predictors peak memory against corpus size (default 256 MiB sample cap)", "rows": rows,
           "command": f"OMP_NUM_THREADS=1 python bench/predictor_memory.py --tokens {a.tokens}"}
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
