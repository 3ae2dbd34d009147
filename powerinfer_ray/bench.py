"""``powerinfer-ray bench <mode>``: dispatch to the benchmark drivers in the repository's bench/.

kernels -> bench/kernels_bench.py; sync -> bench/sync_bench.py (the per-layer channel
microbenchmark); offline -> bench/offline_bench.py (profile and train-predictors through the
engine, timed); scaleout -> bench/scaleout_bench.py (engine replicas behind the Serve app against
one engine); hybrid | layer-offload | dense-gpu | cpu-only | suite -> bench/model_bench.py.
The drivers live beside their results (bench/results/*.json), so they need a source checkout.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
DRIVERS = {"kernels": "kernels_bench", "offline": "offline_bench", "scaleout": "scaleout_bench", "sync": "sync_bench"}
MODEL_MODES = ("hybrid", "layer-offload", "dense-gpu", "cpu-only", "suite")


def load_driver(name: str):  # noqa: ANN202  (a module)
    """The benchmark script bench/<name>.py as a module (its ``main``, its helpers)."""
    path = BENCH_DIR / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"benchmark driver {path} not found: benchmarks run from a source checkout")
    spec = importlib.util.spec_from_file_location(f"powerinfer_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(mode: str, argv: list[str]) -> int:
    if mode in DRIVERS:
        return int(load_driver(DRIVERS[mode]).main(argv) or 0)
    if mode in MODEL_MODES:
        return int(load_driver("model_bench").main(mode, argv) or 0)
    raise ValueError(f"bench mode {mode!r}: expected one of {sorted(DRIVERS) + list(MODEL_MODES)}")
