"""End-to-end benchmark of the engine on planted (or real) models: hybrid vs baselines.

    powerinfer-ray bench hybrid -m planted:llama2-13b?dtype=f16 --vram-budget 16
    powerinfer-ray bench layer-offload -m ... --vram-budget 16     # llama.cpp -ngl style
    powerinfer-ray bench dense-gpu -m ...                           # no budget: the upper bound
    powerinfer-ray bench cpu-only -m ...
    powerinfer-ray bench suite -m ... --vram-budget 16 --modes hybrid,layer-offload,dense-gpu
    powerinfer-ray bench suite -m planted:llama2-13b?dtype=f16 --as-file /dev/shm ...  # from a file
    powerinfer-ray bench suite -m planted:llama3-8b?dtype=f16 --vram-budget 8 \
        --modes hybrid,hybrid-gate-first,hybrid-dense,layer-offload    # a sparsified SwiGLU model

--zero-copy S sets the hybrid engines' share of the CPU shard's neurons that the GPU computes in
decode steps from their rows in host memory (default: the engine's, by batch size); --prefill-share
and --prefill-dense-min the share of its rows streamed to the GPU in prompt chunks.

--as-file DIR writes a planted model to DIR/<shape>.gguf once (bench/planted_file.py, in a process of
its own) and runs every engine from that file, as users run them; the records' ``model`` is the path.

The hybrid modes share the solved placement and differ in the policy: hybrid (the predictors:
on a sparsified SwiGLU model the predicted mode), hybrid-gate-first (a sparsified SwiGLU model's
gate-first mode), hybrid-dense (every neuron, thresholds unused: the dense hybrid).

Every run goes through the real engine (the Coordinator actor and its executors on a local Ray
cluster) with B concurrent requests of random prompts, ignore_eos. It reports decode tokens/s
(decode steps only), upstream's (prompt + output) / time figure separately, prefill tokens/s,
achieved GB/s per device (bytes each executor's weights read over the decode time), the GPU's
share of activated neurons, the per-layer sync time, the per-layer time split, time to first token,
VRAM used and torch's peak allocation, decode graphs captured inside a timed run (none expected), and
host memory: each actor's resident memory (peak, private, mapped file, shared), /dev/shm's growth,
the model file's size and the host's total; the load's seconds by phase. Results go to bench/results/<name>.json (one record per configuration).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MODES = ("hybrid", "hybrid-gate-first", "hybrid-dense", "layer-offload", "dense-gpu", "cpu-only")
HYBRID_POLICY = {"hybrid": "predictor", "hybrid-gate-first": "gate-first", "hybrid-dense": "dense"}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["gpu_mem_gib"] = round(p.total_memory / GIB, 1)
    except ImportError:
        pass
    return info


def commit() -> str:
    """The source's commit: $POWERINFER_COMMIT when set (a copied tree's .git may be stale), else git's
    HEAD, with "-dirty" when tracked files differ from it (a copy whose .git is stale says so, rather
    than passing for the commit it was copied beside). Every benchmark driver records this one."""
    if os.environ.get("POWERINFER_COMMIT"):
        return os.environ["POWERINFER_COMMIT"]
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        return head.stdout.strip() + ("-dirty" if git("diff", "--quiet", "HEAD").returncode else "")
    except OSError:
        return "unknown"


def settings() -> dict[str, str]:
    """The $POWERINFER_RAY_* variables set (kernel builds, fallbacks): part of what was measured."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("POWERINFER_RAY_")}


def write_results(out_dir: str | Path, name: str, command: str, **payload: Any) -> Path:
    """bench/results/<name>.json: machine, commit, command, date, the
    $POWERINFER_RAY_* settings the command ran under, then the payload."""
    doc = {"machine": machine(), "commit": commit(), "command": command, "env": settings(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    out = Path(out_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return out


# ------------------------------------------------------------------------------------------------
def layer_offload_plan(model: str, budget_gib: float, n_ctx: int, batch: int):  # noqa: ANN201
    """llama.cpp -ngl: as many whole layers (attention + dense FFN) on the GPU as the budget
    holds after the embeddings/head, the KV cache of those layers and the workspace; the rest
    entirely on the CPU."""
    from powerinfer_ray.model.costs import model_costs
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.plan import Plan

    cfg = open_model(model).config
    c = model_costs(cfg.with_(predictor_ranks=()), n_ctx, batch)
    per_layer = [c.n_kv_groups * (c.attn_group_bytes[l] + c.kv_group_bytes[l]) + c.n_ff[l] * c.neuron_bytes[l]
                 for l in range(cfg.n_layer)]
    room = budget_gib * GIB - c.dense_bytes - c.workspace_bytes
    k = 0
    while k < cfg.n_layer and room >= per_layer[k]:
        room -= per_layer[k]
        k += 1
    return Plan.whole_layers(cfg, k), k


def engine_kwargs(mode: str, a: argparse.Namespace, n_ctx: int, batch: int,
                  budget: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine of one configuration: KV cache and graphs sized for `batch`, `budget` GiB."""
    kw: dict[str, Any] = dict(max_batch=batch, n_ctx=n_ctx, prefill_chunk=a.prefill_chunk,
                              threads=max(a.threads) if a.threads else None, timeout_s=600.0)
    extra: dict[str, Any] = {}
    if a.decode_burst is not None:
        kw["decode_burst"] = a.decode_burst
    if mode in HYBRID_POLICY:
        kw.update({k: getattr(a, k) for k in ("zero_copy", "prefill_share", "prefill_dense_min", "predictor_qtype")
                   if getattr(a, k) is not None})
    if mode == "hybrid" and a.gpu_fraction is not None:  # the hottest fraction per layer, no solver
        kw.update(gpu_fraction=a.gpu_fraction, policy="predictor")
    elif mode in HYBRID_POLICY:
        kw.update(vram_budget_gib=budget, policy=HYBRID_POLICY[mode], method=a.method,
                  reset_gpu_index=stale_split(a.model, budget))
    elif mode == "layer-offload":
        plan, k = layer_offload_plan(a.model, budget, n_ctx, batch)
        kw.update(plan=plan, policy="dense")
        extra["gpu_layers"] = k
    elif mode == "dense-gpu":
        kw.update(policy="dense")
    elif mode == "cpu-only":
        from powerinfer_ray.model.source import open_model
        from powerinfer_ray.runtime.plan import Plan

        kw.update(plan=Plan.all_cpu(open_model(a.model).config), policy="predictor", device="cpu")
    else:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    return kw, extra


def stale_split(model: str, budget_gib: float) -> bool:
    """Whether the split cached beside a model file was solved for another budget, or does not
    say for which (the engine reuses one solved for a smaller budget, as upstream does; a
    benchmark of this budget must not)."""
    from powerinfer_ray.placement.gpuidx import gpuidx_path, read_gpuidx

    if model.startswith("planted:") or not gpuidx_path(model).exists():
        return False
    return read_gpuidx(gpuidx_path(model)).budget_bytes != int(budget_gib * GIB)


def _delta(after: dict, before: dict, key: str) -> float:
    return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)


def _share_steps(after: dict, before: dict) -> dict[str, int]:
    was = before.get("share_steps") or {}
    return {k: n - was.get(k, 0) for k, n in (after.get("share_steps") or {}).items() if n > was.get(k, 0)}


def run_config(engine, a: argparse.Namespace, batch: int, prompt_len: int, output_len: int,
               n_vocab: int) -> dict[str, Any]:
    """One measurement: `batch` concurrent requests; the numbers of this run only (deltas)."""
    import ray

    rng = np.random.default_rng(prompt_len * 1000 + batch)
    prompts = [rng.integers(3, n_vocab, prompt_len).tolist() for _ in range(batch)]
    s0 = ray.get(engine.stats.remote())
    t0 = time.perf_counter()
    sampling = dict(temperature=a.temperature, top_p=a.top_p) if a.temperature else {}  # seeded: runs repeat
    outs = ray.get([engine.generate.remote(prompt_token_ids=p, max_tokens=output_len, ignore_eos=True, seed=i,
                                           **sampling) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    s1 = ray.get(engine.stats.remote())
    c0, c1 = s0["coordinator"], s1["coordinator"]
    g0, g1 = s0["gpu_executor"], s1["gpu_executor"]
    cpu0, cpu1 = s0.get("cpu_executor", {}), s1.get("cpu_executor", {})
    decode_s, decode_steps = _delta(c1, c0, "decode_s"), _delta(c1, c0, "decode_steps")
    decode_tokens = _delta(c1, c0, "decode_tokens")
    steps = _delta(g1, g0, "steps")
    gpu_bytes = _delta(g1, g0, "active_bytes") + steps * g1.get("read_bytes_per_step", 0)
    cpu_bytes = _delta(cpu1, cpu0, "active_bytes")
    exchanges = _delta(g1, g0, "exchanges")
    dx = _delta(cpu1, cpu0, "decode_exchanges")  # the CPU executor's answers in decode steps
    # GPU share: activated neurons placed on the GPU (the CPU shard's, when the GPU computes them
    # densely for a long prompt, count as the CPU's)
    gn, cn = _delta(g1, g0, "neurons"), _delta(cpu1, cpu0, "neurons") + _delta(g1, g0, "cold_neurons")
    n_layer = a.n_layer
    # time per layer of the steps that spend it: attn / ffn / wait (for the CPU executor's answer)
    # per layer of the eager steps (prefill chunks; host time); of the graph steps (decode): launch
    # (host), exchange (from a post until the GPU saw the answer) and segment (the rest of the
    # step: the GPU's critical path), both by the GPU's clock
    graph_steps = _delta(g1, g0, "graph_steps")
    per_layer = {k: 1e6 * (g1["layer_s"][k] - g0["layer_s"].get(k, 0.0))
                 / max((graph_steps if k in ("launch", "segment", "exchange") else steps - graph_steps) * n_layer, 1)
                 for k in g1["layer_s"]}
    exchange_s = g1["layer_s"]["exchange"] - g0["layer_s"].get("exchange", 0.0)  # decode graphs' (GPU clock)
    gpu_window_s = exchange_s + g1["layer_s"]["segment"] - g0["layer_s"].get("segment", 0.0)
    link_calls = _delta(c1, c0, "link_calls")
    generated = sum(o["stats"]["completion_tokens"] for o in outs)
    ttft = [o["stats"]["ttft_s"] for o in outs if o["stats"].get("ttft_s") is not None]
    prefill_s = _delta(c1, c0, "prefill_s")
    assert generated == batch * output_len, f"lost tokens: {generated} of {batch * output_len}"
    return {
        "batch": batch, "prompt_len": prompt_len, "output_len": output_len, "temperature": a.temperature,
        "top_p": a.top_p,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "decode_step_ms": 1e3 * decode_s / decode_steps if decode_steps else 0.0,  # vs n_layer x per_layer_us
        "e2e_tok_s": batch * (prompt_len + output_len) / wall,
        "prefill_tok_s": _delta(c1, c0, "prompt_tokens") / max(prefill_s, 1e-9),
        # time to first token, median over the requests (submission to the first token: the queue included)
        "ttft_s": float(np.median(ttft)) if ttft else None,
        # the CPU shard's rows streamed to the GPU in prompt chunks, over the prefill steps' time
        "prefill_stream_gbps": _delta(g1, g0, "streamed_bytes") / prefill_s / 1e9 if prefill_s else 0.0,
        "wall_s": wall, "decode_steps": decode_steps,
        "gpu_activation_share": gn / (gn + cn) if gn + cn else 1.0,
        # an exchange's cost beyond the CPU's answer: in decode graphs the GPU's clock from post to the
        # answer seen, less the CPU executor's time on it (eager steps: the host's round trips)
        "per_layer_sync_us": 1e6 * (exchange_s - _delta(cpu1, cpu0, "decode_busy_s")) / dx
        if graph_steps and dx else 1e6 * _delta(g1, g0, "sync_s") / exchanges if exchanges else 0.0,
        # the CPU executor's answers to the decode steps' requests (one token per sequence; a prompt
        # chunk's answer, many times longer, would weigh in otherwise): its time per answer
        "cpu_compute_us_per_exchange": 1e6 * _delta(cpu1, cpu0, "decode_busy_s") / dx if dx else 0.0,
        # of which inside the FFN kernel call (the rest: the CPU executor's Python per answer)
        "cpu_kernel_us_per_exchange": 1e6 * _delta(cpu1, cpu0, "decode_kernel_s") / dx if dx else 0.0,
        # the FFN kernel's read rate there: the rows it read as stored (Q8_0 / Q4_0: compressed bytes) over its time
        "cpu_kernel_gbps": _delta(cpu1, cpu0, "decode_kernel_bytes") / _delta(cpu1, cpu0, "decode_kernel_s") / 1e9
        if _delta(cpu1, cpu0, "decode_kernel_s") else 0.0,
        # over every answer, prompt chunks' included (how these keys read before 2026-12-06)
        "cpu_kernel_us_all_exchanges": 1e6 * _delta(cpu1, cpu0, "kernel_s") / exchanges if exchanges else 0.0,
        # and in the attention of its KV-head groups (projections, rotary, cache, softmax)
        "cpu_attn_us_per_exchange": 1e6 * _delta(cpu1, cpu0, "attn_s") / exchanges if exchanges else 0.0,
        # GPU compute per layer of the decode graphs, their waits for answers left out (0 for eager steps)
        "gpu_compute_us_per_layer": 1e6 * _delta(g1, g0, "gpu_compute_s")
        / max(_delta(g1, g0, "gpu_timed_steps") * n_layer, 1),
        "per_layer_us": per_layer,
        # a decode step's host time outside the GPU's window (its first to last stamp), per graph step:
        # link, the coordinator's step call beyond the primary's (the step link, the coordinator's event
        # loop); primary, the primary's beyond the window (inputs, the launch until the GPU starts, results)
        "decode_link_us": 1e6 * (decode_s / decode_steps - _delta(g1, g0, "graph_busy_s") / graph_steps)
        if decode_steps and graph_steps else 0.0,
        "decode_primary_host_us": 1e6 * (_delta(g1, g0, "graph_busy_s") - gpu_window_s) / graph_steps
        if graph_steps and gpu_window_s else 0.0,
        # of the link's time, per call (prompt chunks' and bursts' included): from the coordinator's
        # send until the primary had read the request, and from the primary's reply until the coordinator
        # had read it
        "link_there_us": 1e6 * _delta(c1, c0, "link_there_s") / link_calls if link_calls else 0.0,
        "link_back_us": 1e6 * _delta(c1, c0, "link_back_s") / link_calls if link_calls else 0.0,
        # decode graphs captured inside this run (a batch bucket the warm-up missed): its decode time
        # includes the capture and the Triton compiles
        "graph_captures": int(_delta(g1, g0, "graph_captures")), "capture_s": _delta(g1, g0, "capture_s"),
        "gpu_gbps": gpu_bytes / decode_s / 1e9 if decode_s else 0.0,
        "cpu_gbps": cpu_bytes / decode_s / 1e9 if decode_s else 0.0,
        # the CPU shard's rows the GPU read in host memory over PCIe (zero-copy decode)
        "zero_copy_gbps": _delta(g1, g0, "host_read_bytes") / decode_s / 1e9 if decode_s else 0.0,
        # decode graph steps by the zero-copy share they ran at (a default share is captured beside none, and
        # the faster set runs: runtime.graphs.ShareChoice)
        "zero_copy_steps": _share_steps(g1, g0),
        "gpu_bytes_per_token": gpu_bytes / max(steps, 1) / batch,
        "cpu_bytes_per_token": cpu_bytes / max(steps, 1) / batch,
        "vram_used_gib": g1.get("vram_used_bytes", 0) / GIB,
        "vram_peak_gib": g1.get("vram_peak_bytes", 0) / GIB,  # torch's peak allocation since the engine started
        "gpu_weight_gib": g1.get("weight_bytes", 0) / GIB,
        "cpu_weight_gib": cpu1.get("weight_bytes", 0) / GIB if cpu1 else 0.0,
        "cpu_threads": cpu1.get("threads") if cpu1 else None,
        **memory_record(s1, a),
    }


def memory_record(stats: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Host memory at the end of a run: each actor's resident memory (``hostmem.process_memory``:
    peak, private = anon, mapped file, shared memory), /dev/shm's growth since before the engine
    started, the model file, the host. beyond_file_gib: what the engine holds besides the model
    file's pages: the actors' private memory and the shared memory it added."""
    from powerinfer_ray.runtime.hostmem import host_memory

    actors = {k: stats[k]["memory"] for k in ("coordinator", "gpu_executor", "cpu_executor")
              if isinstance(stats.get(k), dict) and "memory" in stats[k]}
    host = host_memory()
    shm_added = host.shm_used - a.shm_before
    private = sum(m.get("rss_anon_bytes", 0) for m in actors.values())
    return {"memory": actors, "private_gib": private / GIB, "shm_added_gib": shm_added / GIB,
            "beyond_file_gib": (private + shm_added) / GIB,
            "model_file_gib": a.model_bytes / GIB if a.model_bytes else None, "model_on_tmpfs": a.model_on_tmpfs,
            "host_total_gib": host.total / GIB, "host_available_gib": host.available / GIB}


def wait_warm(engine: Any, timeout_s: float = 300.0) -> dict[str, Any] | None:  # noqa: ANN401
    """Until the CPU executor has mapped its in-place rows (``runtime.warm``: a background thread
    after load, whose page-table work would fall in the first measured tokens), at most
    ``timeout_s``; its warming state (None: no CPU executor, or rows that are not in place), with
    ``waited_s``."""
    import ray

    t0 = time.perf_counter()
    while True:
        cpu = ray.get(engine.stats.remote()).get("cpu_executor")
        warm = (cpu or {}).get("memory", {}).get("warm")
        if warm is None or warm["done"] or time.perf_counter() - t0 > timeout_s:
            return None if warm is None else {**warm, "waited_s": round(time.perf_counter() - t0, 2)}
        time.sleep(0.2)


def run_mode(mode: str, a: argparse.Namespace, batch: int, budget: float,
             done: Any = None) -> list[dict[str, Any]]:  # noqa: ANN401
    """One engine (mode, budget, batch), warmed up at the measured shapes, then every (prompt,
    output) pair of a.shapes; ``done(record)`` is called after each measurement."""
    import ray

    from powerinfer_ray.actors.coordinator import Coordinator
    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.runtime.graphs import ShareChoice

    cfg = open_model(a.model).config
    a.n_layer = cfg.n_layer
    n_ctx = max(p + o for p, o in a.shapes) + 8
    kw, extra = engine_kwargs(mode, a, n_ctx, batch, budget)
    from powerinfer_ray.runtime.hostmem import host_memory

    a.shm_before = host_memory().shm_used
    t0, wall0 = time.perf_counter(), time.time()
    engine = Coordinator.options(name=f"bench-{mode}", max_concurrency=1000).remote(a.model, **kw)
    info = ray.get(engine.ready.remote())
    load_s = time.perf_counter() - t0
    tag = f"[{mode}{'' if mode == 'dense-gpu' else f' {budget:g} GiB'}]"
    print(f"{tag} loaded in {load_s:.1f} s: {info}", flush=True)
    # the coordinator's start (Ray's worker and the modules its class names) and its __init__
    # around the plan and the group; each executor's marks (__init__, load) from the same wall0
    ready = info.get("executors_ready", [])
    load = {"load_phases_s": info.get("load_s"), "coordinator_start_s": info["started_at"] - wall0,
            "coordinator_init_s": info["init_s"],
            "executor_marks_s": [{k: round(t - wall0, 2) for k, t in i.get("marks", {}).items()} for i in ready],
            "executor_phases_s": [i.get("phases") for i in ready],
            "ffn_rows": next((i.get("ffn_rows") for i in ready if "ffn_rows" in i), None),
            "placed": next((i.get("placed") for i in ready if "placed" in i), None)}
    # warm up at the measured shapes (kernel compilation; the decode graphs were captured at the start):
    # the longest prompt's first chunk, then the shortest prompt, each in `batch` requests, the last with as
    # many decode steps as a bucket's zero-copy choice measures before it chooses (runtime.graphs.ShareChoice)
    chunk = info["prefill_chunk"]  # the engine's (by default its budget's: runtime.config.resolve_prefill_chunk)
    warm_lens = sorted({min(max(p for p, _ in a.shapes), chunk), min(p for p, _ in a.shapes)}, reverse=True)
    for n in warm_lens:
        steps = min(2 * ShareChoice.ROUNDS * ShareChoice.BLOCK + 2, n_ctx - n) if n == warm_lens[-1] else 3
        warm = list(range(5, 5 + n))
        ray.get([engine.generate.remote(prompt_token_ids=warm, max_tokens=steps, ignore_eos=True) for _ in range(batch)])
    load["warm_rows"] = wait_warm(engine)
    records = []
    has_cpu = "cpu" in info.get("executors", [])
    sweep = [(p, o, t) for t in (a.threads if a.threads and has_cpu else [None]) for p, o in a.shapes]
    for p, o, t in sweep:
        if t is not None:
            ray.get(engine.set_cpu_threads.remote(t))
        r = run_config(engine, a, batch, p, o, cfg.n_vocab)
        r.update(mode=mode, policy=info.get("policy"), model=a.model, planted=a.planted,
                 vram_budget_gib=budget if mode != "dense-gpu" else None, load_s=load_s, plan_s=info.get("plan_s"),
                 zero_copy=a.zero_copy, prefill_chunk=chunk, prefill_share=a.prefill_share,
                 prefill_dense_min=a.prefill_dense_min, decode_burst=a.decode_burst, **load, **extra)
        print(f"{tag} B={batch} prompt={p} out={o} threads={r['cpu_threads']}: decode {r['decode_tok_s']:.2f} tok/s, "
              f"e2e {r['e2e_tok_s']:.2f}, prefill {r['prefill_tok_s']:.1f} tok/s (TTFT {r['ttft_s'] or 0:.3f} s, rows "
              f"streamed {r['prefill_stream_gbps']:.1f} GB/s), GPU {r['gpu_gbps']:.0f} GB/s, "
              f"CPU {r['cpu_gbps']:.1f} GB/s, zero-copy {r['zero_copy_gbps']:.1f} GB/s, GPU share {r['gpu_activation_share']:.1%}, "
              f"sync {r['per_layer_sync_us']:.0f} us, GPU compute {r['gpu_compute_us_per_layer']:.0f} us/layer, "
              f"CPU compute {r['cpu_compute_us_per_exchange']:.0f} us/exchange "
              f"(kernel {r['cpu_kernel_us_per_exchange']:.0f} at {r['cpu_kernel_gbps']:.1f} GB/s, "
              f"attention {r['cpu_attn_us_per_exchange']:.0f}), "
              f"layer {r['per_layer_us']}, "
              f"VRAM {r['vram_used_gib']:.2f} GiB (peak {r['vram_peak_gib']:.2f}, weights {r['gpu_weight_gib']:.2f}), "
              f"host beyond the file {r['beyond_file_gib']:.2f} GiB "
              f"(private {r['private_gib']:.2f}, shm {r['shm_added_gib']:.2f}; FFN rows: {r['ffn_rows']})", flush=True)
        if r["graph_captures"]:
            print(f"{tag} note: {r['graph_captures']} decode graph set(s) captured inside the timed run "
                  f"({r['capture_s']:.2f} s): the decode numbers include it", flush=True)
        records.append(r)
        if done is not None:
            done(r)
    ray.get(engine.shutdown.remote())
    ray.kill(engine)
    time.sleep(2)
    return records


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="powerinfer-ray bench <mode>")
    ap.add_argument("-m", "--model", default="planted:llama2-7b?dtype=f16")
    ap.add_argument("--vram-budget", default="8", help="GiB; comma-separated for a sweep")
    ap.add_argument("--modes", default=None, help="for 'suite': comma-separated modes")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--prompt", default="64", help="comma-separated prompt lengths")
    ap.add_argument("--output", default="128", help="comma-separated output lengths")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated PROMPTxOUTPUT pairs (e.g. 64x128,1500x128,64x512) measured on one "
                         "engine, instead of every --prompt x --output")
    ap.add_argument("-t", "--threads", default=None,
                    help="CPU executor threads; comma-separated: a sweep on one engine (set live)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="default: the engine's (on CUDA 1024, less where its activations would take over 1/25 of "
                    "the VRAM budget; 64 on CPU)")
    ap.add_argument("--prefill-share", type=float, default=None,
                    help="hybrid modes: the share of the CPU shard's rows the GPU streams in short prompt chunks "
                         "(default: the engine's)")
    ap.add_argument("--prefill-dense-min", type=int, default=None,
                    help="hybrid modes: prompt chunks of at least this many tokens stream every CPU row "
                         "(default: the engine's)")
    ap.add_argument("--decode-burst", type=int, default=None,
                    help="decode steps a round trip to the primary (default: the engine's)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' sampling temperature (default 0: greedy); request i samples with seed i")
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p, with --temperature")
    ap.add_argument("--method", default="ilp", choices=("ilp", "greedy"))
    ap.add_argument("--zero-copy", type=float, default=None,
                    help="hybrid modes: the share of the CPU shard's neurons the GPU computes in decode steps "
                         "(default: the engine's)")
    ap.add_argument("--predictor-qtype", default=None, choices=("auto", "stored", "q8_0", "q4_0"),
                    help="how the primary holds float predictors (the engine's predictor_qtype; default auto)")
    ap.add_argument("--gpu-fraction", type=float, default=None,
                    help="hybrid: put this fraction of each layer's hottest neurons on the GPU instead of solving")
    ap.add_argument("--as-file", default=None, metavar="DIR",
                    help="planted models: write the model to DIR/<shape>.gguf once (e.g. /dev/shm) and run from it")
    ap.add_argument("--name", default=None, help="results file name (default: derived)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--num-cpus", type=int, default=None, help="Ray CPUs (default: all)")
    return ap


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'64x128,1500x128' -> [(64, 128), (1500, 128)]; a clear error for anything else."""
    out = []
    for item in text.split(","):
        p, sep, o = item.strip().partition("x")
        if not sep or not p.isdigit() or not o.isdigit() or int(p) < 1 or int(o) < 1:
            raise ValueError(f"--shapes item {item!r}: expected PROMPTxOUTPUT with positive integers, e.g. 64x128")
        out.append((int(p), int(o)))
    return out


def model_source(a: argparse.Namespace) -> None:
    """--as-file: the planted model written to a file (a process of its own: the generator's GPU
    memory goes with it), and a.model its path; a.planted the spec; the file's size and place."""
    from powerinfer_ray.runtime.hostmem import on_tmpfs

    a.planted = a.model if a.model.startswith("planted:") else None
    if a.as_file:
        if a.planted is None:
            raise ValueError(f"--as-file {a.as_file}: -m {a.model!r} is not a planted: spec (a file is a file already)")
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "planted_file.py"), a.model, "--dir", a.as_file],
                              stdout=subprocess.PIPE, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            raise RuntimeError(f"writing {a.model} to {a.as_file} failed (exit {proc.returncode})")
        a.model = proc.stdout.strip().splitlines()[-1]
    path = None if a.model.startswith("planted:") else Path(a.model)
    a.model_bytes = path.stat().st_size if path is not None else 0
    a.model_on_tmpfs = on_tmpfs(path) if path is not None else None


def main(mode: str, argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    for f in ("batch", "prompt", "output") + (("threads",) if a.threads else ()):
        setattr(a, f, [int(x) for x in str(getattr(a, f)).split(",")])
    budgets = [float(x) for x in str(a.vram_budget).split(",")]
    a.shapes = parse_shapes(a.shapes) if a.shapes else [(p, o) for p in a.prompt for o in a.output]
    modes = (a.modes or "hybrid,layer-offload,dense-gpu").split(",") if mode == "suite" else [mode]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r}: expected one of {MODES} or 'suite'")
    name = a.name or f"{mode}-{a.model.replace('planted:', '').split('?')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    model_source(a)
    from powerinfer_ray.generate import init_ray

    init_ray(num_cpus=a.num_cpus)
    records: list[dict[str, Any]] = []

    def done(r: dict[str, Any]) -> None:  # rewrite the file after every measurement: a run cut
        records.append(r)  # short keeps what it measured
        write_results(a.out_dir, name, "powerinfer-ray bench " + " ".join([mode] + argv), records=records)

    # one engine per (budget, batch): each batch size gets the KV cache and placement it needs
    for budget in budgets:
        for batch in a.batch:
            for m in modes:
                if m == "dense-gpu" and budget != budgets[0]:
                    continue  # no budget: once
                run_mode(m, a, batch, budget, done)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
