"""Decode step time of the in-process engine (``runtime.engine.LocalEngine``) with and without a
CPU executor, on the same model and machine: the exchange between the primary and the CPU
executor (two threads of one process) must not cost more than the work it moves. One engine has
no CPU executor; the others keep the coldest neurons (1 - --gpu-fraction) on a CPU executor,
and --cpu-groups KV-head groups per layer there too (a second exchange per layer).

Both engines are built first; each repeat generates --tokens tokens of one greedy request on
each (in alternating order, so that load from other processes falls on both alike), from a fresh
``asyncio.run`` (the engine is driven from a new event loop every time). step_ms is the median
over repeats of the coordinator's decode seconds per decode step; the host's load average is
recorded beside it.

    python bench/local_engine_bench.py [-m MODEL] [--gpu-fraction 0.5] [--name local-engine-2c]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import write_results  # noqa: E402

from powerinfer_ray.model.default import default_model_path  # noqa: E402
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def decode_ms(eng: LocalEngine, prompt: list[int], tokens: int) -> float:
    """Milliseconds per decode step of one greedy request, driven from a new event loop."""
    before = eng.coordinator.stats()
    asyncio.run(eng.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True))
    after = eng.coordinator.stats()
    return 1e3 * (after["decode_s"] - before["decode_s"]) / (after["decode_steps"] - before["decode_steps"])


def record(eng: LocalEngine, runs: list[float]) -> dict:
    st = eng.stats()
    return {"engine": "local", "cpu_executor": eng.cpu is not None, "step_ms": round(statistics.median(runs), 3),
            "step_ms_runs": [round(r, 3) for r in runs], "policy": eng.primary.policy.name,
            "gpu_fraction": eng.config.gpu_fraction, "cpu_groups": eng.config.cpu_groups,
            "device": str(eng.primary.device),
            "exchanges_per_step": round(st["primary"]["exchanges"] / max(1, st["primary"]["steps"]), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="default: the embedded tiny model")
    ap.add_argument("--gpu-fraction", type=float, default=0.5, help="neurons on the primary, with a CPU executor")
    ap.add_argument("--cpu-groups", default="0,1",
                    help="KV-head groups per layer on the CPU executor: one engine with a CPU executor for each")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None, help="results file name (without .json); default: print only")
    a = ap.parse_args(argv)
    model = a.model or str(default_model_path())
    prompt = list(range(5, 21))
    common = dict(max_batch=1, device="cpu")
    hybrid = [dict(gpu_fraction=a.gpu_fraction, cpu_groups=int(g)) for g in a.cpu_groups.split(",")]
    engines = [LocalEngine(EngineConfig(model, **common, **kw)) for kw in [{}] + hybrid]
    try:
        runs: list[list[float]] = [[] for _ in engines]
        for i in range(a.repeats + 1):  # the first round warms up (thread pools, caches)
            for k in (range(len(engines)) if i % 2 else reversed(range(len(engines)))):
                ms = decode_ms(engines[k], prompt, a.tokens)
                if i:
                    runs[k].append(ms)
        records = [record(e, r) for e, r in zip(engines, runs)]
    finally:
        for e in engines:
            e.close()
    base = records[0]["step_ms"]
    for r in records:
        r["ratio_to_no_cpu_executor"] = round(r["step_ms"] / base, 3)
        print(f"local engine, cpu executor {r['cpu_executor']!s:5} (cpu_groups {r['cpu_groups']}): {r['step_ms']:.2f} ms "
              f"per decode step, x{r['ratio_to_no_cpu_executor']:.2f} ({r['exchanges_per_step']} exchanges per step) "
              f"{r['step_ms_runs']}")
    if a.name:
        write_results(a.out_dir, a.name, "python bench/local_engine_bench.py " + " ".join(argv or sys.argv[1:]),
                      model=model, tokens=a.tokens, repeats=a.repeats,
                      load_average=[round(x, 2) for x in os.getloadavg()], records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
