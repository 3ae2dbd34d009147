"""Benchmark of the placement solver: the paper's ILP (cvxpy + HiGHS) vs the greedy baseline on
real model shapes with planted power-law activation profiles.

    python bench/placement_bench.py                      # llama2-70b and llama2-13b, default budgets
    python bench/placement_bench.py --shapes llama2-70b --budgets 40,64 --out bench/results

Shapes: Llama-2-70B (80 layers x 28672 neurons, GQA 8 KV heads) and Llama-2-13B (40 x 13824),
ReGLU, fp16, predictors of width 1024 (70B) / 1024 -> 2048 across layers (13B), 4096 context,
batch 1, groups of 64 neurons. Profiles: per layer, frequency of the neuron of rank k is
min(1, c k^-alpha), alpha ~ U(1.3, 1.5) per layer, c set so 15 % of neurons fire per token (DESIGN 3:
15.6 % on the planted 13B); neurons shuffled; counts ~ Binomial(n_tokens, f).

Reports per (shape, sync time, budget): ILP wall seconds (problem build + greedy incumbent + HiGHS) and
process CPU seconds, objective (sum of frequencies served by the GPU, plus attention units when
placeable) beside greedy's and the communication-aware greedy's, GPU share of activations, how
many layers hold GPU neurons, attention groups on the GPU, C_l. Target: 70B in <= 10 s.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TARGET_70B_S = 10.0

SHAPES: dict[str, dict[str, Any]] = {
    "llama2-70b": dict(n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8, n_vocab=32000,
                       gated=True, dtype_bytes=2, predictor_ranks=[1024] * 80, n_ctx=4096, batch=1),
    "llama2-13b": dict(n_layer=40, n_embd=5120, n_ff=13824, n_head=40, n_head_kv=40, n_vocab=32000,
                       gated=True, dtype_bytes=2, predictor_ranks=np.linspace(1024, 2048, 40).astype(int).tolist(),
                       n_ctx=4096, batch=1),
}
BUDGETS_GIB = {"llama2-70b": [24, 40, 64, 80], "llama2-13b": [8, 12, 16, 24]}


import powerinfer_ray.placement as P  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))  # the drivers share model_bench's helpers
from model_bench import commit  # noqa: E402


def power_law_counts(n_layer: int, n_ff: int, n_tokens: int, active: float, seed: int) -> list[np.ndarray]:
    """[L][n_ff] counts: frequency of rank k = min(1, c k^-alpha), mean `active`, shuffled."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, n_ff + 1, dtype=np.float64)
    counts = []
    for _ in range(n_layer):
        alpha = rng.uniform(1.3, 1.5)  # top 20 % of neurons carry ~80 % (DESIGN 3: 79 %)
        lo, hi = 0.0, float(n_ff) ** alpha  # bisect c so the mean frequency is `active`
        for _ in range(100):
            c = (lo + hi) / 2
            lo, hi = (c, hi) if np.minimum(1, c * ranks ** -alpha).mean() < active else (lo, c)
        f = np.minimum(1.0, c * ranks ** -alpha)[rng.permutation(n_ff)]
        counts.append(rng.binomial(n_tokens, f))
    return counts


def profile_stats(counts: list[np.ndarray], n_tokens: int) -> dict[str, float]:
    f = np.concatenate(counts) / n_tokens
    top = np.sort(f)[::-1][: f.size // 5]
    return {"mean_active": round(float(f.mean()), 4), "top20_share": round(float(top.sum() / f.sum()), 4)}


def bench_one(costs, counts, n_tokens: int, budget_gib: float, host) -> dict[str, Any]:
    budget = int(budget_gib * P.GIB)
    t0, c0 = time.perf_counter(), time.process_time()
    problem = P.build_problem(counts, n_tokens, costs, budget, host)
    ilp = P.solve_ilp(problem)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()
    greedy = P.solve_greedy(problem)
    greedy_s = time.perf_counter() - t1
    greedy_c = P.solve_greedy(problem, communication=True)
    return {
        "budget_gib": budget_gib, "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
        "status": ilp.status, "objective": round(ilp.objective, 3),
        "greedy_objective": round(greedy.objective, 3), "greedy_seconds": round(greedy_s, 3),
        "greedy_comm_objective": round(greedy_c.objective, 3),
        "ilp_vs_greedy": round(ilp.objective / greedy.objective, 5) if greedy.objective else None,
        "gpu_share": round(ilp.gpu_share, 4), "greedy_gpu_share": round(greedy.gpu_share, 4),
        "gpu_neurons": int(sum(ilp.gpu_counts())), "layers_with_gpu_neurons": int(sum(n > 0 for n in ilp.gpu_counts())),
        "greedy_layers_below_C": int(sum(0 < n < c for n, c in zip(greedy.gpu_counts(), problem.min_gpu_neurons))),
        "attention_placeable": problem.attention_placeable,
        "attention_groups_on_gpu": int(ilp.gpu_attention.sum()), "attention_groups": int(ilp.gpu_attention.size),
        "C_l_min_max": [int(problem.min_gpu_neurons.min()), int(problem.min_gpu_neurons.max())],
        "gpu_gib_used": round(ilp.gpu_bytes(costs) / P.GIB, 3),
    }


def machine_info(name: str | None) -> dict[str, Any]:
    import cvxpy

    return {"machine": name or f"cpu-{os.cpu_count()}c", "host": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "cvxpy": cvxpy.__version__,
            "highspy": _version("highspy"), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def _version(pkg: str) -> str:
    from importlib.metadata import version
    return version(pkg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama2-70b,llama2-13b")
    ap.add_argument("--budgets", default=None, help="GiB, comma-separated (default: per shape)")
    ap.add_argument("--n-tokens", type=int, default=100_000)
    ap.add_argument("--active", type=float, default=0.15, help="mean fraction of neurons active per token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync-us", default="45,450",
                    help="per-layer sync times to run, comma-separated: 45 = DESIGN's measurement; "
                         "10x that is a stress case where the communication constraint bites")
    ap.add_argument("--machine", default=None, help="name in the output file (default cpu-<N>c)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the solves: a bad --out fails at once
    info = machine_info(args.machine)
    record: dict[str, Any] = {**info, "commit": commit(), "command": " ".join(["placement_bench.py", *sys.argv[1:]]),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host_profile": vars(P.HostProfile()),
                              "group_size": 64, "results": []}
    ok = True
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        costs = P.ModelCosts.from_shape(**shape)
        counts = power_law_counts(shape["n_layer"], shape["n_ff"], args.n_tokens, args.active, args.seed)
        budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else BUDGETS_GIB[name]
        for sync_us, budget in itertools.product([float(x) for x in args.sync_us.split(",")], budgets):
            host = P.HostProfile(sync_us=sync_us)
            row = {"shape": name, "sync_us": sync_us, **profile_stats(counts, args.n_tokens),
                   "model_gib": round(costs.total_bytes / P.GIB, 2), **bench_one(costs, counts, args.n_tokens, budget, host)}
            record["results"].append(row)
            if name == "llama2-70b":
                ok &= row["seconds"] <= TARGET_70B_S
            print(f"{name} sync {sync_us:>4.0f} us {budget:>5.1f} GiB  ilp {row['seconds']:6.2f} s (cpu {row['cpu_seconds']:5.2f})  "
                  f"{row['status']:<10} obj {row['objective']:>10.1f}  greedy {row['greedy_objective']:>10.1f}  "
                  f"GPU share {row['gpu_share']:.1%}  layers {row['layers_with_gpu_neurons']}  "
                  f"attn {row['attention_groups_on_gpu']}/{row['attention_groups']}", flush=True)
    record["target_70b_seconds"] = TARGET_70B_S
    record["target_met"] = ok
    out = Path(args.out) / f"placement-{info['machine']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'PASS' if ok else 'FAIL'}: 70B within {TARGET_70B_S} s; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
