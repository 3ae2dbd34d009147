"""The sparse FFN kernels under Nsight Compute: what limits them (one call each, 13B shape, fp16).

Runs each configuration's op a few times (compiled and warm), then once more inside
cudaProfilerStart/Stop, so `ncu --profile-from-start off` sees exactly one call per case:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python bench/ncu_ffn.py

(--clock-control none: the GPU's clocks are left as they are.) Cases: T = 1 fused (the default),
T = 1 two-stage, T = 8 two-stage (the default) and T = 8 split (POWERINFER_RAY_GPU_SPLIT=1's
configuration), at --density (default 10 %).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import GPU, idx_sets, make_weights  # noqa: E402

from powerinfer_ray.kernels import triton_ffn as tf  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--density", type=float, default=10.0, help="percent of active neurons")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(1)
    up, gate, down_t = make_weights(torch.float16, GPU, gen)
    _, sets = idx_sets(args.density / 100, GPU, gen)
    gemv, dot = tf.CONFIGS["gemv"], tf.CONFIGS["dot"]
    cases = {"T1 fused": (1, gemv), "T1 two-stage": (1, dataclasses.replace(gemv, fused_r=0)),
             "T8 two-stage": (8, dot), "T8 split": (8, tf.SPLIT_DOT)}
    for name, (T, cfg) in cases.items():
        x = torch.randn(T, up.shape[1], generator=gen).abs().half().to(GPU)
        out = torch.empty_like(x)
        for s_ in sets:  # compiled and warm
            tf.sparse_ffn_triton(x, up, gate, down_t, s_, None, "reglu", None, out, None, cfg)
        torch.cuda.synchronize()
        print(f"[ncu] {name}: {cfg}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        tf.sparse_ffn_triton(x, up, gate, down_t, sets[0], None, "reglu", None, out, None, cfg)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
