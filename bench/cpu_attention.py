"""The CPU executor's attention of one decode token at a model's shape, split into its parts: the
q/k/v projection and the output projection through `cpu_ffn.linear` (the compiled `pi_linear`,
fp16 rows read in place), and the whole `kernels.attention.head_attention` call as the CPU
executor makes it (rotary, KV-cache write, SDPA, both projections, Python). Weights of L layers
rotate call by call, so they come from DRAM as in the runtime. A dense FFN layer's rows through
the FFN kernel (`sparse_ffn_bitmask`, every row, skip_zero=False: the layer-offload baseline's
read) are timed beside them, the same bytes' reference rate.

    python bench/cpu_attention.py --shape falcon-40b -t 14 --out-dir bench/results

Writes <out-dir>/<name>.json (machine, commit, command, medians, GB/s) when --out-dir is given.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import write_results  # noqa: E402

from powerinfer_ray.kernels import cpu_ffn  # noqa: E402
from powerinfer_ray.kernels.attention import head_attention  # noqa: E402

SHAPES = {  # D, query heads, KV heads, head dim, n_ff
    "falcon-40b": (8192, 128, 8, 64, 32768),
    "llama2-13b": (5120, 40, 40, 128, 13824),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="falcon-40b")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=8, help="layers' weights rotated (cold in the caches)")
    ap.add_argument("--calls", type=int, default=40, help="timed calls per part")
    ap.add_argument("--pos", type=int, default=64, help="the token's position (keys attended)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--name", default="cpu-attention")
    a = ap.parse_args(argv)
    threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    D, H, G, hd, n_ff = SHAPES[a.shape]
    gen = torch.Generator().manual_seed(0)

    def w(r: int, c: int) -> torch.Tensor:
        return (torch.randn(r, c, generator=gen) * c ** -0.5).half()

    layers = []
    for _ in range(a.layers):  # as the CPU executor holds them: wqkv rows, wo row-major [D, H*hd]
        wqkv, wo = w((H + 2 * G) * hd, D), w(D, H * hd)
        kc, vc = torch.zeros(2, G, a.pos + 8, hd), torch.zeros(2, G, a.pos + 8, hd)
        layers.append((wqkv, wo, kc, vc))
    ffn = [(w(n_ff, D).abs_(), w(n_ff, D)) for _ in range(2)]  # ReLU up rows (positive x: all fire), down_t
    x = torch.randn(1, 1, D, generator=gen).abs()
    o = torch.randn(1, H * hd, generator=gen)

    def lin(xx, ww, b):  # noqa: ANN001, ANN202
        return cpu_ffn.linear(xx, ww, b, threads)

    def attention(i: int) -> None:
        wqkv, wo, kc, vc = layers[i % len(layers)]
        head_attention(x, wqkv[:H * hd], wqkv[H * hd:(H + G) * hd], wqkv[(H + G) * hd:], wo.T, kc, vc, [0], [a.pos],
                       10000.0, "neox", None, wqkv=wqkv, linear=lin)

    out = torch.empty(1, D)
    parts = {
        "qkv_linear": (lambda i: lin(x[0], layers[i % len(layers)][0], None), layers[0][0].numel() * 2),
        "out_linear": (lambda i: lin(o, layers[i % len(layers)][1], None), layers[0][1].numel() * 2),
        "head_attention": (attention, (layers[0][0].numel() + layers[0][1].numel()) * 2),
        "ffn_dense_layer": (lambda i: cpu_ffn.sparse_ffn_bitmask(x[0].half(), ffn[i % 2][0], None, ffn[i % 2][1],
                                                                  None, n_ff, "relu", None, out, threads,
                                                                  skip_zero=False), 2 * n_ff * D * 2),
    }
    times = {k: [] for k in parts}
    order = list(parts)
    rng = random.Random(0)
    for i in range(a.calls + 3):
        rng.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            parts[k][0](i)
            if i >= 3:
                times[k].append(time.perf_counter() - t0)
    rows = []
    for k, ts in times.items():
        med, nbytes = statistics.median(ts), parts[k][1]
        rows.append(dict(part=k, median_us=round(med * 1e6, 1), bytes=nbytes, GBps=round(nbytes / med / 1e9, 1)))
        print(f"[cpu attention] {a.shape} t={threads}: {k} {med * 1e6:.0f} us, {nbytes / 1e6:.0f} MB, "
              f"{nbytes / med / 1e9:.1f} GB/s", flush=True)
    if a.out_dir:
        write_results(a.out_dir, a.name, "python bench/cpu_attention.py " + " ".join(argv or sys.argv[1:]),
                      shape=dict(zip(("D", "n_head", "n_head_kv", "head_dim", "n_ff"), SHAPES[a.shape])),
                      threads=threads, layers=a.layers, pos=a.pos, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
