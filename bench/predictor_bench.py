"""The decode segment's predictor front alone: relu(fc1 . h.to(dtype)) for one token, by torch's
kernels (the cast, cuBLAS's GEMV, the ReLU) and by ``triton_predictor.predictor_hidden`` at each
tiling of ``--configs``, then fc2 (cuBLAS) after it, as the segment runs them.

    python bench/predictor_bench.py --out-dir bench/results --name predictor-13b-h100

Each way is captured in one CUDA graph over ``--layers`` layers, each layer on its own fc1 / fc2
copy (more bytes than the L2 holds, as in the decode step), and timed per layer as the median of
``--reps`` replays. The ceiling is a device-to-device copy of the same bytes in the same run.
Every way is checked against float64 first.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def per_layer_us(fn, layers: int, reps: int) -> float:
    """Median µs a layer of ``fn(l)`` for l in range(layers), captured in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for l in range(layers):
            fn(l)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for l in range(layers):
            fn(l)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / layers)
    return statistics.median(ts)


def main() -> int:
    from model_bench import write_results
    from powerinfer_ray.kernels.triton_predictor import predictor_hidden

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=5120, help="D, the residual's width (13B: 5120)")
    p.add_argument("--rank", type=int, default=1024, help="fc1's rows (the 13B predictor's: 1024)")
    p.add_argument("--n-ff", type=int, default=13824, help="fc2's rows")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--configs", default="1x1024x4,2x1024x4,4x1024x4,4x512x4,8x1024x8,2x512x2",
                   help="Triton tilings, rows a program x columns a step x warps")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="predictor")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("predictor_bench needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.float16
    D, r, N, L = a.dim, a.rank, a.n_ff, a.layers
    gen = torch.Generator(device=dev).manual_seed(0)
    fc1 = [(torch.randn(r, D, generator=gen, device=dev) * D ** -0.5).to(dt) for _ in range(L)]
    fc2 = [(torch.randn(N, r, generator=gen, device=dev) * r ** -0.5).to(dt) for _ in range(L)]
    h = torch.randn(1, D, generator=gen, device=dev) * 3
    want = [torch.relu(h.to(dt).double() @ w.double().T) for w in fc1[:2]]
    out = torch.empty(1, N, dtype=dt, device=dev)

    def torch_front(l: int) -> torch.Tensor:
        return torch.relu(h.to(dt) @ fc1[l].T)

    ways = {"torch": torch_front}
    for c in a.configs.split(","):
        br, bk, w = (int(v) for v in c.split("x"))
        ways[f"triton_{c}"] = lambda l, br=br, bk=bk, w=w: predictor_hidden(h, fc1[l], dt, br, bk, w)
    fc1_bytes, fc2_bytes = r * D * 2, N * r * 2
    src = torch.empty(L * fc1_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_us = per_layer_us(lambda l: dst[l * fc1_bytes:(l + 1) * fc1_bytes].copy_(
        src[l * fc1_bytes:(l + 1) * fc1_bytes]), L, a.reps)
    records = [{"way": "copy_ceiling", "us_per_layer": copy_us, "gbps": 2 * fc1_bytes / copy_us / 1e3}]
    print(f"copy of fc1's bytes: {copy_us:.2f} us a layer ({2 * fc1_bytes / copy_us / 1e3:.0f} GB/s read + write)")
    for name, fn in ways.items():
        for l in range(2):
            err = ((fn(l).double() - want[l]).norm() / want[l].norm()).item()
            assert err < 2e-3, f"{name}: relative error {err:.2e} against float64"
        front = per_layer_us(fn, L, a.reps)
        both = per_layer_us(lambda l: torch.matmul(fn(l), fc2[l].T, out=out), L, a.reps)
        records.append({"way": name, "front_us_per_layer": front, "front_gbps": fc1_bytes / front / 1e3,
                        "with_fc2_us_per_layer": both, "with_fc2_gbps": (fc1_bytes + fc2_bytes) / both / 1e3})
        print(f"{name}: front {front:.2f} us ({fc1_bytes / front / 1e3:.0f} GB/s), with fc2 {both:.2f} us "
              f"({(fc1_bytes + fc2_bytes) / both / 1e3:.0f} GB/s)", flush=True)
    write_results(a.out_dir, a.name, "python bench/predictor_bench.py " + shlex.join(sys.argv[1:]),
                  dim=D, rank=r, n_ff=N, layers=L, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
