"""The layer-offload baseline beside the hybrid in the in-process engine (``runtime.engine.LocalEngine``,
no Ray), per weight type: load, a prompt's prefill and decode steps, and the CPU executor's time
per exchange in its FFN kernel and in the attention of its heads. For finding where a baseline's
time goes without the actors, on any host (the primary on CUDA when there is one).

layer-offload: policy 'dense', layers 0 .. --gpu-layers - 1 whole on the primary, the rest whole
on the CPU executor (``Plan.whole_layers``); hybrid: policy 'predictor', the hottest
--gpu-fraction of each layer's neurons and every head on the primary.

    python bench/layer_offload_local.py -m "planted:llama2-13b?layers=2" --dtypes q4_0,q8_0,f16 \\
        [--gpu-layers 1] [--threads 14] [--name layer-offload-local-2c]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import write_results  # noqa: E402

from powerinfer_ray.model.source import open_model  # noqa: E402
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine  # noqa: E402
from powerinfer_ray.runtime.plan import Plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def with_dtype(model: str, dtype: str) -> str:
    """A planted spec with ``dtype=`` set (replacing one it has)."""
    name, _, query = model.partition("?")
    keep = [kv for kv in query.split("&") if kv and not kv.startswith("dtype=")]
    return f"{name}?{'&'.join(keep + [f'dtype={dtype}'])}"


def measure(model: str, mode: str, a: argparse.Namespace) -> dict:
    """One engine: load, a prompt of --prompt tokens, --tokens decode steps (the median step)."""
    cfg = open_model(model).config
    kw = dict(policy="dense", plan=Plan.whole_layers(cfg, a.gpu_layers)) if mode == "layer-offload" \
        else dict(policy="predictor", gpu_fraction=a.gpu_fraction)
    t0 = time.perf_counter()
    eng = LocalEngine(EngineConfig(model, max_batch=1, n_ctx=a.prompt + a.tokens + 8, prefill_chunk=a.prompt,
                                   threads=a.threads, **kw))
    try:
        load_s = time.perf_counter() - t0
        prompt = np.random.default_rng(0).integers(3, cfg.n_vocab, a.prompt).tolist()
        t1 = time.perf_counter()
        eng.primary.step([0], [prompt], [0])
        prefill_s = time.perf_counter() - t1
        st, steps = eng.cpu.stats, []
        e0, k0, a0 = st.exchanges, st.kernel_s, st.attn_s
        for i in range(a.tokens):
            t1 = time.perf_counter()
            eng.primary.step([0], [[5 + i]], [a.prompt + i])
            steps.append(time.perf_counter() - t1)
        ex = max(st.exchanges - e0, 1)
        return {"model": model, "mode": mode, "device": str(eng.primary.device), "load_s": round(load_s, 2),
                "load_phases_s": eng.group.load_s, "executor_phases_s": [r.get("phases") for r in eng.group.ready],
                "prefill_s": round(prefill_s, 3), "decode_ms": round(1e3 * statistics.median(steps), 2),
                "decode_ms_steps": [round(1e3 * s, 2) for s in steps],
                "cpu_kernel_us_per_exchange": round(1e6 * (st.kernel_s - k0) / ex, 1),
                "cpu_attn_us_per_exchange": round(1e6 * (st.attn_s - a0) / ex, 1),
                "cpu_threads": eng.cpu.threads, "cpu_pinned": eng.cpu.pinned}
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="planted:llama2-13b?layers=2", help="a planted spec (dtype= is set)")
    ap.add_argument("--dtypes", default="q4_0,q8_0,f16")
    ap.add_argument("--modes", default="layer-offload,hybrid")
    ap.add_argument("--gpu-layers", type=int, default=1, help="layer-offload: whole layers on the primary")
    ap.add_argument("--gpu-fraction", type=float, default=0.5, help="hybrid: neurons on the primary")
    ap.add_argument("--threads", type=int, default=None, help="CPU executor threads")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None, help="results file name (without .json); default: print only")
    a = ap.parse_args(argv)
    records = []
    for dtype in a.dtypes.split(","):
        for mode in a.modes.split(","):
            r = measure(with_dtype(a.model, dtype), mode, a)
            print(f"{dtype} {mode}: load {r['load_s']} s, prefill {a.prompt} {r['prefill_s']} s, decode "
                  f"{r['decode_ms']} ms/token; CPU executor per exchange: kernel {r['cpu_kernel_us_per_exchange']} "
                  f"us, attention {r['cpu_attn_us_per_exchange']} us (threads {r['cpu_threads']}, pinned "
                  f"{r['cpu_pinned']})", flush=True)
            records.append(r)
    if a.name:
        write_results(a.out_dir, a.name, "python bench/layer_offload_local.py " + " ".join(argv or sys.argv[1:]),
                      records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
