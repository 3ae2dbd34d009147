"""The sparse FFN kernels under Nsight Compute: what limits them (one call each, 13B shape, fp16).

Runs each configuration's op a few times (compiled and warm), then once more inside
cudaProfilerStart/Stop, so `ncu --profile-from-start off` sees exactly one call per case:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python bench/ncu_ffn.py

(--clock-control none: the GPU's clocks are left as they are.) Cases: T = 1 fused (the default),
T = 1 two-stage and T = 8 two-stage (the default), on fp16 rows and, with --qtype, on ggml
q4_0 / q8_0 rows, at --density (default 10 %).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import D, GPU, idx_sets, weights  # noqa: E402

from powerinfer_ray.kernels import triton_ffn as tf  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--density", type=float, default=10.0, help="percent of active neurons")
    p.add_argument("--qtype", choices=["q4_0", "q8_0"], default=None, help="quantized rows instead of fp16")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(1)
    up, gate, down_t = weights(args.qtype or "fp16", GPU, gen)
    _, sets = idx_sets(args.density / 100, GPU, gen)
    gemv, dot = tf.CONFIGS["gemv"], tf.CONFIGS["dot"]
    cases = {"T1 fused": (1, gemv), "T1 two-stage": (1, dataclasses.replace(gemv, fused_r=0)),
             "T8 two-stage": (8, dot)}
    for name, (T, cfg) in cases.items():
        x = torch.randn(T, D, generator=gen).abs().half().to(GPU)
        out = torch.empty_like(x)
        for s_ in sets:  # compiled and warm
            tf.sparse_ffn_triton(x, up, gate, down_t, s_, None, "reglu", None, out, None, cfg, qtype=args.qtype)
        torch.cuda.synchronize()
        print(f"[ncu] {name} {args.qtype or 'fp16'}: {cfg}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        tf.sparse_ffn_triton(x, up, gate, down_t, sets[0], None, "reglu", None, out, None, cfg, qtype=args.qtype)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
