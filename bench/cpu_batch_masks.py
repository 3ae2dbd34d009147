"""The CPU executor's answer for a batch of T sequences whose active rows differ (batched decode):
each (token, row) of an n = 8600-row fp16 shard (13B shape) active with probability P, so the
union of rows is large while each row is active for few tokens. Median ms of sparse_ffn_bitmask
over 4 layers' shards in turn (--threads, default 2; --split, the kernel's work split, default the
runtime's auto). Prints, writes nothing.

    python bench/cpu_batch_masks.py -T 32 -P 0.05 --split cols
"""
import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer_ray.kernels import cpu_ffn, cpu_library

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("-T", type=int, default=32, help="tokens (sequences) in the batch")
ap.add_argument("-P", type=float, default=0.05, help="probability of each (token, row)")
ap.add_argument("-t", "--threads", type=int, default=2, help="the kernel's threads")
ap.add_argument("--split", default="auto", choices=tuple(cpu_ffn.SPLITS), help="the kernel's work split")
ap.add_argument("--cflags", default="", help="extra compiler flags of the kernel build (cpu_library.select_build)")
a = ap.parse_args()
cpu_library.select_build(a.cflags.split())
torch.manual_seed(0)
n, D, L, T, p = 8600, 5120, 4, a.T, a.P
layers = [[(torch.randn(n, D) * D ** -0.5).half() for _ in range(3)] for _ in range(L)]
for w in layers:
    w[1].abs_()  # gate > 0: activations nonzero where the mask says
x = torch.randn(T, D).half()
out = torch.empty(T, D, dtype=torch.float16)
rng = np.random.default_rng(0)
masks = [np.packbits(rng.random((T, n)) < p, axis=1, bitorder="little") for _ in range(8)]
ts = []
for i in range(60):
    up, gate, down = layers[i % L]
    t0 = time.perf_counter()
    cpu_ffn.sparse_ffn_bitmask(x, up, gate, down, masks[i % 8], n, "reglu", None, out, a.threads, split=a.split)
    if i >= 10:
        ts.append(time.perf_counter() - t0)
union = np.mean([np.unpackbits(m, axis=1, count=n, bitorder="little").any(0).mean() for m in masks])
print(f"{a.cflags or 'default'}: T={T} p={p} threads={a.threads} split={a.split} union {union:.0%}: {statistics.median(ts) * 1e3:.2f} ms")
