"""Profile decode steps of the in-process engine (no Ray) with torch.profiler: where a token's
time goes on the GPU executor, per op, on CPU and CUDA.

    python bench/profile_step.py -m "planted:llama2-13b?dtype=f16&layers=4" --policy dense
    python bench/profile_step.py -m ... --policy predictor --gpu-fraction 0.3 [--prefill] [--no-graphs]
    python bench/profile_step.py -m model.gguf --policy predictor --vram-budget 16 --prefill --trace t.json.gz

With --prefill and --trace, the prompt's GPU work per CUDA stream (the compute stream and the copy
stream of the CPU shard's streamed rows): busy time, gaps, and its top kernels.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from powerinfer_ray.kernels import cpu_ffn
from powerinfer_ray.model.source import open_model
from powerinfer_ray.runtime.engine import EngineConfig, LocalEngine
from powerinfer_ray.runtime.plan import Plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--policy", default="dense")
    ap.add_argument("--gpu-fraction", type=float, default=None)
    ap.add_argument("--vram-budget", type=float, default=None, help="GiB: the engine's split for this budget")
    ap.add_argument("--prefill-share", type=float, default=None)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of --prefill")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--prefill", action="store_true", help="profile a 64-token prefill instead of decode steps")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode steps (no CUDA graphs)")
    ap.add_argument("--trace", help="also write the profile as a Chrome trace (gzip) to this path")
    a = ap.parse_args()
    cfg = open_model(a.model).config
    if a.vram_budget is not None:
        kw = dict(vram_budget_gib=a.vram_budget)
    else:
        kw = dict(gpu_fraction=a.gpu_fraction) if a.gpu_fraction is not None else dict(plan=Plan.all_gpu(cfg))
    n = a.prompt
    t0 = time.perf_counter()
    e = LocalEngine(EngineConfig(a.model, policy=a.policy, max_batch=1, n_ctx=n + 192, prefill_chunk=n,
                                 threads=a.threads, graphs=False if a.no_graphs else None,
                                 prefill_share=a.prefill_share, **kw))
    print(f"loaded in {time.perf_counter() - t0:.1f} s; cpu kernel available: {cpu_ffn.available()}", flush=True)
    p = e.primary
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    prompt = [10 + i % 1000 for i in range(n)]
    for i in range(3):
        t0 = time.perf_counter()
        p.step([0], [prompt], [0])
        sync()
        print(f"prefill of {n} tokens: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    for i in range(5):
        p.step([0], [[5]], [n + i])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(a.steps):
        p.step([0], [[5]], [n + 5 + i])
    dt = (time.perf_counter() - t0) / a.steps
    print(f"decode step {dt * 1e3:.2f} ms ({cfg.n_layer} layers: {dt * 1e6 / cfg.n_layer:.0f} us/layer)", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        if a.prefill:
            p.step([0], [prompt], [0])
            sync()
        else:
            for i in range(5):
                p.step([0], [[5]], [n + 36 + i])
    if a.trace:
        import gzip
        import os
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            prof.export_chrome_trace(fh.name)
        with open(fh.name, "rb") as src, gzip.open(a.trace, "wb") as dst:
            dst.write(src.read())
        os.unlink(fh.name)
        print(streams_timeline(a.trace) if a.prefill else segment_timeline(a.trace))
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=a.rows))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.rows))
    if e.cpu is not None:
        print("cpu executor:", e.cpu.stats.as_dict())
    print("primary:", p.stats.as_dict())
    e.close()


def _gpu_events(trace: str) -> list[dict]:
    import gzip
    import json

    ev = json.load(gzip.open(trace))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    return sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])


def streams_timeline(trace: str, top: int = 6) -> str:
    """A step's GPU work per CUDA stream, from a Chrome trace: the step's span (first GPU event to
    last), each stream's busy time and share of the span, and its costliest ops (us)."""
    from collections import defaultdict

    gpu = _gpu_events(trace)
    if not gpu:
        return "no GPU events in the trace"
    t0, t1 = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    by: dict[object, list[dict]] = defaultdict(list)
    for e in gpu:
        by[e.get("args", {}).get("stream")].append(e)
    lines = [f"GPU span {t1 - t0:.0f} us, {len(gpu)} ops on {len(by)} streams"]
    for sid, evs in sorted(by.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        busy = sum(e["dur"] for e in evs)
        lines.append(f"stream {sid}: {len(evs)} ops, busy {busy:.0f} us ({busy / (t1 - t0):.0%} of the span), "
                     f"first {evs[0]['ts'] - t0:.0f} us, last end {max(e['ts'] + e['dur'] for e in evs) - t0:.0f} us")
        cost: dict[str, list[float]] = defaultdict(list)
        for e in evs:
            cost[e["name"][:70]].append(e["dur"])
        for name, d in sorted(cost.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"    {sum(d):9.0f} us  {len(d):5d} x {sum(d) / len(d):8.1f}  {name}")
    return "\n".join(lines)


def segment_timeline(trace: str) -> str:
    """The GPU's work between seeing the CPU executor's answer and posting the next request (the
    step's critical path on the GPU), from a Chrome trace of decode graphs: per position in the
    segment, the op and the medians over the segments of its gap before it and its duration (us)."""
    import numpy as np

    gpu = _gpu_events(trace)
    segs, cur = [], None
    for e in gpu:
        if e["name"].startswith("_await_kernel"):
            cur = [e]
        elif cur is not None:
            cur.append(e)
            if e["name"].startswith("_post_kernel"):
                segs.append(cur)
                cur = None
    if not segs:
        return "no segment between an await and a post in the trace"
    n = min(len(s) for s in segs)
    segs = [s for s in segs if len(s) == n]  # segments of the same shape
    lines = [f"segment timeline: {len(segs)} segments of {n - 1} ops after the await (medians, us)",
             f"{'op':60s} {'gap':>7s} {'dur':>7s}"]
    for i in range(1, n):
        gap = np.median([s[i]["ts"] - (s[i - 1]["ts"] + s[i - 1]["dur"]) for s in segs])
        dur = np.median([s[i]["dur"] for s in segs])
        lines.append(f"{segs[0][i]['name'][:60]:60s} {gap:7.1f} {dur:7.1f}")
    total = np.median([s[-1]["ts"] + s[-1]["dur"] - (s[0]["ts"] + s[0]["dur"]) for s in segs])
    busy = np.median([sum(e["dur"] for e in s[1:]) for s in segs])
    lines.append(f"segment {total:.1f} us: ops {busy:.1f}, gaps {total - busy:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
