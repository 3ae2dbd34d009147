"""Engine replicas behind one Serve app against one engine: aggregate tokens/s and latency
percentiles over HTTP, as clients see them.

    python bench/scaleout_bench.py -m "planted:llama2-13b?dtype=f16" --as-file /dev/shm \\
        --vram-budget 16 --replicas 1,2 -t 14 --batch 8 --prompt 64 --output 128
    powerinfer-ray bench scaleout ...          # the same

For each replica count R: R engines (R = 1: the single engine), each with 1/R of the VRAM budget,
``--replica-gpus`` of a GPU (default 1/R: all on the host's one GPU) and (t + 1) // R - 1 CPU
executor threads (each replica's GPU executor holds a CPU too), behind the app on 127.0.0.1.
``batch`` x R concurrent streamed requests of random prompts (``ignore_eos``) go in together,
``rounds`` times after a warm-up round. Reported: the aggregate tokens/s (generated tokens over
the rounds' wall time), each replica's share and tokens/s (by the ``X-Powerinfer-Engine``
header) and engine-side decode tokens/s, and latency percentiles (end to end, time to the first
token, time per output token after it). Results: bench/results/<name>.json, rewritten after
every replica count.

On a host with one GPU the replicas share it, its host's cores and its memory bandwidth: that
measures the routing and the contention of engines on one GPU, not scaling, which needs a GPU
per replica. ``--solo`` adds, before each R > 1, one engine alone with a replica's share (1/R of
the budget, its threads): R replicas against R times that tells the contention from the split budget.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import model_source, stale_split, write_results  # noqa: E402

from powerinfer_ray.serve.ingress import ENGINE_HEADER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "scaleout-engine"
READY_TIMEOUT_S = 600.0
NOTE = ("On a host with one GPU the replicas share it (and its host's cores and memory bandwidth): this "
        "measures the routing and the contention of engines on one GPU, not scaling, which needs a GPU per replica.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="powerinfer-ray bench scaleout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="planted:llama2-7b?dtype=f16")
    ap.add_argument("--as-file", default=None, metavar="DIR",
                    help="planted models: write the model to DIR/<shape>.gguf once (e.g. /dev/shm) and run from it")
    ap.add_argument("--vram-budget", type=float, default=None, help="GiB for all replicas together (each: 1/R)")
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts, each measured in turn")
    ap.add_argument("--replica-gpus", type=float, default=None, help="a GPU's share per replica (default: 1/R)")
    ap.add_argument("-t", "--threads", type=int, default=None,
                    help="CPU executor threads of the single engine; R replicas get (t + 1) // R - 1 each")
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests per replica")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--output", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    ap.add_argument("--solo", action="store_true",
                    help="before each R > 1, one engine alone with a replica's share (1/R of the budget, its "
                         "threads, the whole GPU): what R replicas lose to sharing one GPU, apart from the split budget")
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when there is a GPU")
    ap.add_argument("--policy", default=None, help="the engines' policy (default: the model's)")
    ap.add_argument("--num-cpus", type=int, default=None, help="Ray CPUs (default: all)")
    ap.add_argument("--name", default=None, help="results file name (default: scaleout-<shape>-<time>)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return ap


def replica_threads(threads: int | None, replicas: int) -> int | None:
    """A replica's CPU executor threads: the single engine's ``threads`` plus its GPU executor's CPU,
    shared among the replicas, less each one's GPU executor CPU."""
    return None if threads is None else max(1, (threads + 1) // replicas - 1)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def one_request(url: str, model: str, prompt: list[int], output: int, start: threading.Barrier) -> dict[str, Any]:
    """A streamed completion: the replica that served it, its tokens, and when they came."""
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    start.wait()
    t0 = time.perf_counter()
    first, tokens, error = None, 0, None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as r:
        engine = r.headers.get(ENGINE_HEADER)
        if r.status_code != 200:
            return {"engine": engine, "error": r.text[:300], "tokens": 0}
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"][:300]
                continue
            n = len(event["choices"][0].get("token_ids") or ())
            if n and first is None:
                first = time.perf_counter()
            tokens += n
    end = time.perf_counter()
    ttft = (first or end) - t0
    return {"engine": engine, "tokens": tokens, "error": error, "start": t0, "end": end, "e2e_s": end - t0,
            "ttft_s": ttft, "tpot_s": (end - first) / (tokens - 1) if first and tokens > 1 else None}


def run_round(url: str, model: str, prompts: list[list[int]], output: int) -> tuple[list[dict], float]:
    """All prompts at once (a barrier releases them together); the requests and the round's wall time."""
    start = threading.Barrier(len(prompts))
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda p: one_request(url, model, p, output, start), prompts))
    done = [r for r in out if "start" in r]
    wall = max(r["end"] for r in done) - min(r["start"] for r in done) if done else 0.0
    return out, wall


def start_engines(a: argparse.Namespace, replicas: int, share_of: int | None = None) -> tuple[list[Any], dict[str, Any]]:
    """The engines of one configuration, loaded; their Replica handles and the config's numbers.
    share_of: a single engine with the budget and threads of one of that many replicas."""
    import ray

    from powerinfer_ray.actors.replicas import Replica, start_replicas
    from powerinfer_ray.runtime.config import EngineConfig
    from powerinfer_ray.runtime.preflight import prepare
    from powerinfer_ray.serve.launcher import start_engine

    parts = share_of or replicas
    budget = a.vram_budget / parts if a.vram_budget else None
    gpus = a.replica_gpus or 1.0 / replicas
    ec = EngineConfig(a.model, vram_budget_gib=budget, threads=replica_threads(a.threads, parts),
                      max_batch=a.batch, n_ctx=a.prompt + a.output + 1, device=a.device, policy=a.policy,
                      timeout_s=600.0, reset_gpu_index=budget is not None and stale_split(a.model, budget))
    ec = prepare(ec).config  # the placement solved once, here
    t0 = time.perf_counter()
    if replicas == 1:
        engine, _ = start_engine(ec, name=ENGINE)
        engines = [Replica(ENGINE, engine)]
    else:
        engines = start_replicas(ec, replicas, gpus, name=ENGINE)
    ready = ray.get([r.engine.ready.remote() for r in engines], timeout=READY_TIMEOUT_S)
    config = {"config": label(replicas, share_of), "replicas": replicas, "share_of": parts,
              "vram_budget_gib_per_replica": budget, "replica_gpus": gpus if replicas > 1 else 1,
              "threads_per_replica": ec.threads, "batch_per_replica": a.batch, "concurrency": a.batch * replicas,
              "prompt_len": a.prompt, "output_len": a.output, "rounds": a.rounds,
              "load_s": round(time.perf_counter() - t0, 2),
              "engines": {r.name: {k: i.get(k) for k in ("node_id", "device", "pid", "init_s", "load_s")}
                          for r, i in zip(engines, ready)}}
    return engines, config


def wait_all_up(url: str, replicas: int) -> None:
    """Until the app's /health reports every replica up (the router sends requests only to those)."""
    deadline = time.time() + READY_TIMEOUT_S
    while True:
        r = requests.get(f"{url}/health", timeout=60)
        states = [x["state"] for x in r.json().get("replicas", [])] if r.status_code == 200 else []
        if states == ["up"] * replicas:
            return
        if time.time() > deadline:
            raise RuntimeError(f"the app's replicas are not all up after {READY_TIMEOUT_S:g} s: {r.text[:300]}")
        time.sleep(0.5)


def label(replicas: int, share_of: int | None = None) -> str:
    return f"1 engine at 1/{share_of}" if share_of else f"{replicas} replica{'s' if replicas > 1 else ''}"


def measure(a: argparse.Namespace, replicas: int, url: str, share_of: int | None = None) -> dict[str, Any]:
    """One replica count (or one engine with a replica's share): its engines behind the app, a
    warm-up round, ``rounds`` measured rounds."""
    import ray
    from ray import serve

    from powerinfer_ray.actors.replicas import stop_replicas
    from powerinfer_ray.serve.app import build_app

    engines, record = start_engines(a, replicas, share_of)
    try:
        serve.run(build_app(engines[0].engine if replicas == 1 else engines), name="scaleout", route_prefix="/")
        wait_all_up(url, replicas)
        info = ray.get(engines[0].engine.model_info.remote())
        rng = np.random.default_rng(replicas)
        n = a.batch * replicas
        run_round(url, info["name"], [rng.integers(3, info["n_vocab"], a.prompt).tolist() for _ in range(n)],
                  min(a.output, 8))  # warm-up: the batch's decode graphs captured, kernels built
        before = {r.name: ray.get(r.engine.stats.remote())["coordinator"] for r in engines}
        reqs, wall = [], 0.0
        for i in range(a.rounds):
            out, w = run_round(url, info["name"],
                               [rng.integers(3, info["n_vocab"], a.prompt).tolist() for _ in range(n)], a.output)
            reqs += out
            wall += w
            print(f"{record['config']} round {i + 1}/{a.rounds}: {sum(r.get('tokens', 0) for r in out) / w if w else 0.0:.1f} tok/s "
                  f"in {w:.1f} s", flush=True)
        after = {r.name: ray.get(r.engine.stats.remote())["coordinator"] for r in engines}
    finally:
        serve.delete("scaleout")
        stop_replicas(engines)
    record.update(summarize(reqs, wall, before, after))
    return record


def summarize(reqs: list[dict], wall: float, before: dict[str, dict], after: dict[str, dict]) -> dict[str, Any]:
    """Aggregate and per-replica tokens/s, errors, latency percentiles of the measured rounds."""
    ok = [r for r in reqs if r["error"] is None]
    per = {}
    for name in after:
        mine = [r for r in ok if r["engine"] == name]
        dt = after[name]["decode_s"] - before[name]["decode_s"]
        per[name] = {"requests": len(mine), "tokens": sum(r["tokens"] for r in mine),
                     "tok_s": sum(r["tokens"] for r in mine) / wall if wall else 0.0,
                     "engine_decode_tok_s": (after[name]["decode_tokens"] - before[name]["decode_tokens"]) / dt
                     if dt else 0.0}
    return {"wall_s": wall, "requests": len(reqs), "errors": len(reqs) - len(ok),
            "aggregate_tok_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0, "per_replica": per,
            "latency_s": {k: percentiles([r[k] for r in ok if r.get(k) is not None])
                          for k in ("e2e_s", "ttft_s", "tpot_s")}}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    counts = [int(x) for x in a.replicas.split(",")]
    if any(c < 1 for c in counts) or a.batch < 1 or a.rounds < 1:
        raise ValueError(f"--replicas {a.replicas}, --batch {a.batch}, --rounds {a.rounds}: expected integers >= 1")
    name = a.name or f"scaleout-{a.model.replace('planted:', '').split('?')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = "python bench/scaleout_bench.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    model_source(a)
    from ray import serve

    from powerinfer_ray.serve.launcher import init_ray

    init_ray(num_cpus=a.num_cpus)
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    records: list[dict[str, Any]] = []
    runs: list[tuple[int, int | None]] = []  # (engines, a replica's share of that many) in order
    for count in counts:
        runs += [(1, count)] if a.solo and count > 1 else []
        runs.append((count, None))
    for count, share_of in runs:
        r = measure(a, count, f"http://127.0.0.1:{port}", share_of)
        records.append(r)
        lat = r["latency_s"]
        print(f"{r['config']}: {r['aggregate_tok_s']:.1f} tok/s aggregate ("
              + ", ".join(f"{n} {p['tok_s']:.1f}" for n, p in r["per_replica"].items())
              + f"), e2e p50 {lat['e2e_s'].get('p50', 0):.2f} s p99 {lat['e2e_s'].get('p99', 0):.2f} s, "
              f"ttft p50 {lat['ttft_s'].get('p50', 0):.3f} s, errors {r['errors']}", flush=True)
        base = records[0]["aggregate_tok_s"]
        write_results(a.out_dir, name, command, note=NOTE, model=a.model, records=records,
                      aggregate_vs_first={x["config"]: x["aggregate_tok_s"] / base if base else None
                                          for x in records})
    serve.shutdown()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
