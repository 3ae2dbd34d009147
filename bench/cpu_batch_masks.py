"""The CPU executor's answer for a batch of T sequences whose active rows differ (batched decode):
each (token, row) of an n = 8600-row fp16 shard (13B shape) active with probability P, so the
union of rows is large while each row is active for few tokens. Median ms of sparse_ffn_bitmask
over 4 layers' shards in turn (2 threads). A/B the kernel's per-token path with
POWERINFER_RAY_CPU_CFLAGS=-DPI_DENSE_TOKENS (always the blocked path). Dev-machine tool: prints,
writes nothing.

    T=32 P=0.05 python bench/cpu_batch_masks.py
"""
import os, time, statistics, numpy as np, torch
from powerinfer_ray.kernels import cpu_ffn
torch.manual_seed(0)
n, D, L, T = 8600, 5120, 4, int(os.environ.get("T", "32"))
p = float(os.environ.get("P", "0.05"))
layers = [[(torch.randn(n, D) * D ** -0.5).half() for _ in range(3)] for _ in range(L)]
for l in layers: l[1].abs_()  # gate > 0: activations nonzero where the mask says
x = torch.randn(T, D).half(); out = torch.empty(T, D, dtype=torch.float16)
rng = np.random.default_rng(0)
masks = [np.packbits(rng.random((T, n)) < p, axis=1, bitorder="little") for _ in range(8)]
ts = []
for i in range(60):
    up, gate, down = layers[i % L]
    t0 = time.perf_counter()
    cpu_ffn.sparse_ffn_bitmask(x, up, gate, down, masks[i % 8], n, "reglu", None, out, 2)
    if i >= 10: ts.append(time.perf_counter() - t0)
union = np.mean([np.unpackbits(m, axis=1, count=n, bitorder="little").any(0).mean() for m in masks])
print(f"{os.environ.get('POWERINFER_RAY_CPU_CFLAGS') or 'default'}: T={T} p={p} union {union:.0%}: {statistics.median(ts)*1e3:.2f} ms")
