"""``powerinfer-ray generate``: start a local Ray cluster, build the engine, stream one completion,
print decode tokens/s at the end (like llama.cpp's timings)."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any


def init_ray(num_cpus: int | None = None, dashboard: bool = False, quiet: bool = True,
             namespace: str | None = None) -> None:
    """Join the cluster named by RAY_ADDRESS, or start a local one (named actors go to ``namespace``)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"include_dashboard": dashboard, "log_to_driver": not quiet, "namespace": namespace}
    if not os.environ.get("RAY_ADDRESS") and num_cpus is not None:
        kw["num_cpus"] = num_cpus
    ray.init(**kw)


def _spinner(msg: str, stop: threading.Event) -> None:
    t0 = time.perf_counter()
    while not stop.wait(0.5):
        print(f"\r{msg} {time.perf_counter() - t0:5.1f} s", end="", file=sys.stderr, flush=True)
    print(f"\r{msg} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def start_engine(model: str, name: str = "powerinfer-engine", **engine_kwargs: Any):  # noqa: ANN201
    """Create the engine actor and wait until its executors have loaded (with a progress line)."""
    import ray

    from .actors.coordinator import Coordinator

    engine = Coordinator.options(name=name, max_concurrency=1000).remote(model, **engine_kwargs)
    stop = threading.Event()
    th = threading.Thread(target=_spinner, args=(f"loading {os.path.basename(model)}:", stop), daemon=True)
    th.start()
    try:
        info = ray.get(engine.ready.remote())
    finally:
        stop.set()
        th.join()
    return engine, info


def generate_cli(model: str, prompt: str, n_predict: int, *, stream: bool, sampling: dict[str, Any],
                 vram_budget_gib: float | None = None, **engine_kwargs: Any) -> int:
    import ray

    init_ray()
    engine, info = start_engine(model, vram_budget=vram_budget_gib, **engine_kwargs)
    kw = dict(max_tokens=n_predict, **{k: v for k, v in sampling.items() if v is not None})
    t0 = time.perf_counter()
    print(prompt, end="", flush=True)
    if stream:
        finish = None
        for ref in engine.generate_stream.remote(prompt, **kw):
            chunk = ray.get(ref)
            print(chunk["text"], end="", flush=True)
            finish = chunk.get("stats") or finish
        stats = finish or {}
    else:
        out = ray.get(engine.generate.remote(prompt, **kw))
        print(out["text"], end="")
        stats = out["stats"]
    print()
    wall = time.perf_counter() - t0
    load = ray.get(engine.stats.remote())
    gpu = load["gpu_executor"]
    print(f"\n[{info['model']}] {stats.get('completion_tokens', 0)} tokens in {wall:.2f} s; "
          f"decode {stats.get('decode_tok_s') or 0:.1f} tok/s; time to first token "
          f"{(stats.get('ttft_s') or 0) * 1e3:.0f} ms; GPU share of activated neurons "
          f"{gpu.get('gpu_activation_share', 0):.1%}; sync {gpu.get('per_exchange_sync_us', 0):.0f} us/exchange",
          file=sys.stderr)
    ray.get(engine.shutdown.remote())
    return 0
