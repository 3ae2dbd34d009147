"""The re-placement decision loop (runtime/replacement.py's Replacer) on synthetic traffic, without
an engine: the planted 13B whose hot set follows its prompts' token range, binomial activation
counts per interval from its planted statistics, the engine's budget (the ILP solves the static
split and the oracle's). Traffic A for --a-intervals, then B; after each interval, what the
replacer decided and the true GPU share of B's activations of the split it holds (the oracle's:
the split solved from B's statistics).

    python bench/replacement_sim.py --half-life 1      # decayed counts halve every interval
    python bench/replacement_sim.py --half-life 4
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from powerinfer_ray.model.source import open_model
from powerinfer_ray.placement.result import gpu_share
from powerinfer_ray.placement.solve import solve_placement
from powerinfer_ray.runtime import replacement as R
from powerinfer_ray.runtime.config import EngineConfig, placement_inputs, predictor_qtype
from powerinfer_ray.runtime.plan import Plan


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/replacement_sim.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="planted:llama2-13b?dtype=f16&ranges=2")
    ap.add_argument("--vram-budget", type=float, default=16.0)
    ap.add_argument("--half-life", type=int, default=R.HALF_LIFE_INTERVALS, help="intervals")
    ap.add_argument("--interval", type=int, default=256, help="tokens")
    ap.add_argument("--threshold", type=float, default=EngineConfig.replacement_threshold)
    ap.add_argument("--a-intervals", type=int, default=4)
    ap.add_argument("--intervals", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    R.HALF_LIFE_INTERVALS = a.half_life
    src = open_model(a.model)
    ec = EngineConfig(a.model, vram_budget_gib=a.vram_budget, max_batch=1, n_ctx=200, policy="predictor",
                      disable_gpu_index=True, device="cuda")
    costs, budget, host = placement_inputs(ec, src, predictor_qtype(ec, src))
    L = src.config.n_layer
    p = [np.stack([src.predictor_probs(l, r) for l in range(L)]) for r in (0, 1)]  # [L, F] per range
    counts_a = src.activation_counts(1_000_000, 0)
    static = solve_placement(*counts_a, costs, budget, host)
    plan = Plan.from_masks(static.gpu_neurons, list(static.gpu_attention), src.config).hot_first(counts_a[0])
    oracle = solve_placement(*src.activation_counts(1_000_000, 1), costs, budget, host)

    print(f"static: share {plan.gpu_activation_share(p[0]):.4f} on A, {plan.gpu_activation_share(p[1]):.4f} on B; "
          f"oracle on B {gpu_share(oracle.gpu_neurons, p[1]):.4f}")
    rep = R.Replacer(plan, R.Settings(a.interval, a.threshold), costs.neuron_bytes)
    rng = np.random.default_rng(a.seed)
    totals, tokens = np.zeros_like(p[0]), 0
    for i in range(a.intervals):
        kind = 0 if i < a.a_intervals else 1
        totals += rng.binomial(a.interval, p[kind])
        tokens += a.interval
        rep.observe(totals.copy(), tokens)
        if not rep.ready:
            continue
        taken = rep.judge()
        while rep.queue:
            rep.applied(rep.queue.popleft(), 0.0)
        print(f"interval {i} ({'AB'[kind]}): {'moved' if taken else 'kept '} gain unseen {rep.counters['last_gain']:+.4f} "
              f"fitted {rep.counters['last_gain_fitted']:+.4f}, share on B "
              f"{rep.plan.gpu_activation_share(p[1]):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
