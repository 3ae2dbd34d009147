"""The sampler's time per token (``runtime.sampling.sample``, what the scheduler or a burst's primary
runs once per sequence and decode step) beside a full-sort sampler (torch.sort of the vocabulary,
torch.multinomial: the sampler before 71206d0) in the same process, on CPU.

    python bench/sampling_bench.py --out-dir bench/results --name sampling-devbox

Logits are normal draws times ``--scales`` (larger: a peakier distribution, a narrower nucleus);
each configuration is timed over ``--iters`` draws, median of ``--reps`` repeats, microseconds.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {"temperature": dict(temperature=0.8), "top_k 40": dict(temperature=0.8, top_k=40),
           "top_p 0.95": dict(temperature=0.8, top_p=0.95), "top_p 0.999": dict(temperature=1.0, top_p=0.999)}


def full_sort(logits: np.ndarray, p, gen: torch.Generator) -> int:  # noqa: ANN001
    """The baseline: the whole vocabulary sorted for the nucleus, torch.multinomial for the draw."""
    x = torch.as_tensor(logits, dtype=torch.float32) / p.temperature
    if p.top_k and p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        probs = torch.zeros_like(probs).scatter_(0, si, sp * (torch.cumsum(sp, 0) - sp < p.top_p))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def timed(fn, logits: np.ndarray, p, iters: int, reps: int) -> float:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        fn(logits, p, gen)
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(logits, p, gen)
        runs.append(1e6 * (time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def main() -> int:
    from model_bench import write_results
    from powerinfer_ray.runtime.sampling import SamplingParams, sample

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--scales", type=float, nargs="+", default=[2.0, 8.0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads (the coordinator's: 1)")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--name", default="sampling")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    records = []
    for V in a.vocab:
        for scale in a.scales:
            logits = (np.random.default_rng(V).standard_normal(V) * scale).astype(np.float32)
            for name, kw in CONFIGS.items():
                p = SamplingParams(**kw)
                r = {"vocab": V, "scale": scale, "config": name, "sample_us": timed(sample, logits, p, a.iters, a.reps),
                     "full_sort_us": timed(full_sort, logits, p, a.iters, a.reps)}
                records.append(r)
                print(f"V={V} scale={scale} {name}: sample {r['sample_us']:.0f} us, "
                      f"full sort {r['full_sort_us']:.0f} us")
    write_results(a.out_dir, a.name, "python bench/sampling_bench.py " + shlex.join(sys.argv[1:]),
                  threads=a.threads, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
