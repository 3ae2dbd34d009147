"""Online re-placement on a shifted workload (runtime/replacement.py): a split solved from one kind
of traffic, served another, static against re-placed against the split solved on the served
traffic itself.

    # the embedded model on this CPU: profiled on the pydoc help pages, served stdlib docstrings
    python bench/replacement_bench.py --sync-us 0 --name replacement-tiny-cpu
    # the planted 13B whose hot set follows its prompts' token range, from a file on /dev/shm
    python bench/replacement_bench.py -m "planted:llama2-13b?dtype=f16&ranges=2" --as-file /dev/shm \\
        --vram-budget 16 -t 14 --name replacement-13b-16gib-h200

Traffic A is what the split was solved from, B what is served after the shift: for a model file,
windows of two corpora (A profiled with ``offline.profile``, over --profile-tokens); for a
planted model with ``ranges=2``, prompts of random tokens of the vocabulary's lower (A) and upper
(B) half (A's statistics are the planted ones the engine places a planted model by). Requests of
--prompt tokens generating --output, --batch at a time. Five engines (Ray Coordinators, as users
run them), one after another, one budget, one split solver (the engine's own inputs: ``config.placement_inputs``):

  static    the split solved from A; re-placement off. Serves A, then B.
  oracle    the split solved from B's statistics (the planted ones; for text, the reference over
            the served windows); re-placement off. Serves B.
  replaced  the same split as static; re-placement on. Serves A (the unshifted case: it must cost
            nothing), then B, measured after --after served tokens of B (the move is done by then).
  oracle    again: serves B.
  static    again, last: serves A.

--unshifted N measures the unshifted case alone, without engine-to-engine drift in the way: N
rounds of three engines serving A in turn, static, re-placed, and idle (re-placement on with an
interval no measurement reaches: the replacer built, its loop never reading counts or solving),
in an order that rotates every round and reverses every other one (each kind in each place
alike over six rounds); unshifted_ratio and idle_ratio are the re-placed and idle engines' mean
decode tok/s over the static ones'.

Engines of one call differ by up to ~10 % at the same split and traffic (the CPU kernel's time per
token, engine to engine): the replaced engine is compared with the mean of the two engines of each
kind, which bracket it. Every engine measures B on the same prompts. Each measurement is --measure
served tokens: decode tok/s (decode steps only), the GPU's share of the activated neurons (the
primary's, as bench/model_bench.py reports it) and ms per decode token by part. The JSON's summary
holds gpu_share_{static,replaced,oracle} and decode_tok_s_* on B (the oracle's: the mean of its two
engines), speedup_vs_static, replaced_vs_oracle (against that mean; _first against the first
alone, oracle_b_drift the last against the first), unshifted_ratio (replaced / the static engines'
mean on A; unshifted_ratio_first against the first alone, static_a_drift the last against the
first) and the replacer's counters.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the drivers share model_bench's helpers
from model_bench import ROOT, model_source, wait_warm, write_results

from powerinfer_ray.runtime.config import EngineConfig

GIB = 1 << 30
NEVER = 1 << 40  # --unshifted's idle engine: an interval no measurement reaches


# ------------------------------------------------------------------------------------------------
# traffic
# ------------------------------------------------------------------------------------------------
class Traffic:
    """Prompts of kind A or B, and the statistics of each kind ([L][n_ff] counts, tokens)."""

    def __init__(self, a: argparse.Namespace, cfg: Any) -> None:  # noqa: ANN401
        self.a, self.cfg = a, cfg
        self.planted = a.planted is not None and "ranges=2" in a.planted
        if not self.planted:
            from powerinfer_ray.model.gguf_file import ModelFile
            from powerinfer_ray.model.tokenizer import Tokenizer

            self.tok = Tokenizer(ModelFile(a.model).fields)

    def prompts(self, kind: str, seed: int) -> Iterator[list[int]]:
        """Kind A's or B's prompts, the same ones at every call (text: the corpus's windows in order)."""
        if not self.planted:
            from powerinfer_ray.offline.corpus import iter_texts
            from powerinfer_ray.offline.stream import token_windows

            yield from token_windows(self.tok, iter_texts(self.a.profile_corpus if kind == "A" else self.a.serve_corpus),
                                     self.a.prompt)
            return
        from powerinfer_ray.model.planted import planted_model

        lo, hi = planted_model(self.a.planted.removeprefix("planted:")).range_tokens(0 if kind == "A" else 1)
        rng = np.random.default_rng(seed)
        while True:
            yield rng.integers(lo, hi, self.a.prompt).tolist()

    def statistics(self, kind: str, served: list[list[int]]) -> tuple[list[np.ndarray], int]:
        """A's: the planted statistics, or a profile of corpus A; B's: the planted ones, or the
        reference's activations over the windows served."""
        if self.planted:
            from powerinfer_ray.model.planted import planted_model

            return planted_model(self.a.planted.removeprefix("planted:")).activation_counts(100_000, 0 if kind == "A" else 1)
        from powerinfer_ray.offline.profile import CountingHooks, load_reference, profile_activations
        from powerinfer_ray.offline.stream import run_windows

        if kind == "A":
            st = profile_activations(self.a.model, self.a.profile_corpus, self.a.profile_tokens, seq_len=self.a.prompt,
                                     progress=False, device="cpu")
            return list(st.counts), st.n_tokens
        ref, _ = load_reference(self.a.model, "cpu")
        hooks = CountingHooks(ref.cfg.n_layer, ref.cfg.n_ff, ref.device)
        n = run_windows(ref, served, hooks)
        return list(hooks.counts.numpy()), n


# ------------------------------------------------------------------------------------------------
# engines and measurements
# ------------------------------------------------------------------------------------------------
def solved_plan(a: argparse.Namespace, stats: tuple[list[np.ndarray], int]):  # noqa: ANN201
    """The split the engine would solve from ``stats`` (its own placement inputs), CPU rows hottest first."""
    from dataclasses import replace

    from powerinfer_ray.model.source import open_model
    from powerinfer_ray.placement.solve import solve_placement
    from powerinfer_ray.runtime.config import placement_inputs, predictor_qtype
    from powerinfer_ray.runtime.plan import Plan

    src = open_model(a.model)
    ec = EngineConfig(a.model, **base_options(a))
    pq = predictor_qtype(ec, src)  # how the engine holds the predictors at this budget
    costs, budget, host = placement_inputs(ec, src, pq)
    placement = solve_placement(stats[0], stats[1], costs, budget, host)
    plan = Plan.from_masks(placement.gpu_neurons, list(placement.gpu_attention), src.config)
    return replace(plan, predictor_qtype=pq).hot_first(stats[0]), placement


def base_options(a: argparse.Namespace) -> dict[str, Any]:
    return dict(vram_budget_gib=a.vram_budget, max_batch=a.batch, n_ctx=a.prompt + a.output + 8, threads=a.threads,
                policy="predictor", disable_gpu_index=True, host_profile=a.host_profile, timeout_s=600.0)


def start(a: argparse.Namespace, name: str, plan: Any, replacement: str, interval: int):  # noqa: ANN201, ANN401
    import ray

    from powerinfer_ray.actors.coordinator import Coordinator

    t0 = time.perf_counter()
    eng = Coordinator.options(name=f"replacement-{name}", max_concurrency=1000).remote(
        a.model, plan=plan, replacement=replacement, replacement_interval=interval,
        replacement_threshold=a.threshold, **base_options(a))
    info = ray.get(eng.ready.remote())
    warm = [5 + i % 50 for i in range(a.prompt)]  # kernels compiled, decode graphs captured
    ray.get([eng.generate.remote(prompt_token_ids=warm, max_tokens=4, ignore_eos=True) for _ in range(a.batch)])
    rows = wait_warm(eng)  # every engine measured with its CPU rows mapped
    pinned = [i["pinned"] for i in info["executors_ready"] if "pinned" in i]  # the CPU workers' cores
    a.pinned = pinned  # recorded with the measurements of this engine (one engine runs at a time)
    print(f"[{name}] loaded and warm in {time.perf_counter() - t0:.1f} s: {info['load_s']}, rows {rows}, "
          f"CPU workers pinned to {pinned}", flush=True)
    return eng


def serve(eng: Any, a: argparse.Namespace, prompts: Iterator[list[int]], tokens: int,  # noqa: ANN401
          served: list[list[int]] | None = None) -> dict[str, Any]:
    """Requests of the given prompts, ``a.batch`` at a time, until ``tokens`` served (prompt and
    output); decode tok/s and the GPU's share of the activated neurons over them."""
    import ray

    s0, t0, done = ray.get(eng.stats.remote()), time.perf_counter(), 0
    while done < tokens:
        batch = [next(prompts) for _ in range(a.batch)]
        if served is not None:
            served.extend(batch)
        ray.get([eng.generate.remote(prompt_token_ids=p, max_tokens=a.output, ignore_eos=True, temperature=0)
                 for p in batch])
        done += sum(len(p) for p in batch) + a.batch * a.output
    s1 = ray.get(eng.stats.remote())
    # (a budget that holds the whole model starts no CPU executor: its part is absent)
    d = lambda part, key: float(s1.get(part, {}).get(key, 0)) - float(s0.get(part, {}).get(key, 0))  # noqa: E731
    gpu = d("gpu_executor", "neurons")
    cpu = d("cpu_executor", "neurons") + d("gpu_executor", "cold_neurons")
    n = d("coordinator", "decode_tokens")
    layer = lambda key: float(s1.get("gpu_executor", {}).get("layer_s", {}).get(key, 0)) - float(  # noqa: E731
        s0.get("gpu_executor", {}).get("layer_s", {}).get(key, 0))
    # where a token's time went (prefill steps included in the executors' parts): ms per decode token
    per_token = {"decode": d("coordinator", "decode_s"), "gpu_busy": d("gpu_executor", "busy_s"),
                 "gpu_launch": layer("launch"), "gpu_segment": layer("segment"), "gpu_exchange": layer("exchange"),
                 "cpu_busy": d("cpu_executor", "busy_s"), "cpu_kernel": d("cpu_executor", "kernel_s")}
    return {"served_tokens": done, "wall_s": time.perf_counter() - t0,
            "ms_per_decode_token": {k: round(1e3 * v / n, 3) for k, v in per_token.items()} if n else None,
            "decode_tok_s": n / d("coordinator", "decode_s"),
            "gpu_share": gpu / (gpu + cpu) if gpu + cpu else 1.0,
            "gpu_move_s": d("gpu_executor", "move_s"), "replacement": s1["replacement"]}


def settle(eng: Any, timeout_s: float = 120.0) -> bool:  # noqa: ANN401
    """Wait until no solve is pending and no pause queued (True), or the timeout (False)."""
    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        r = ray.get(eng.stats.remote())["replacement"]
        if not r["solving"] and not r["queued_pauses"]:
            return True
        time.sleep(0.5)
    return False


@contextmanager
def engine(a: argparse.Namespace, name: str, plan: Any, replacement: str,  # noqa: ANN401
           interval: int | None = None) -> Iterator[Any]:
    """An engine (``start``) for the block, shut down and killed after it."""
    import ray

    eng = start(a, name, plan, replacement, a.interval if interval is None else interval)
    try:
        yield eng
    finally:
        ray.get(eng.shutdown.remote())
        ray.kill(eng)
        time.sleep(2)


# ------------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> dict[str, Any]:
    from powerinfer_ray.model.source import open_model

    cfg = open_model(a.model).config
    traffic = Traffic(a, cfg)
    served_b: list[list[int]] = []
    out: dict[str, Any] = {"records": []}

    def measure(eng: Any, engine: str, kind: str, phase: str, tokens: int,  # noqa: ANN401
                served: list[list[int]] | None = None) -> dict[str, Any]:
        r = {"engine": engine, "traffic": kind, "phase": phase, "pinned": a.pinned,
             **serve(eng, a, traffic.prompts(kind, 1 if kind == "A" else 2), tokens, served)}
        out["records"].append(r)
        print(f"[{engine}] {kind} {phase}: decode {r['decode_tok_s']:.2f} tok/s, GPU share {r['gpu_share']:.1%} "
              f"over {r['served_tokens']} tokens ({r['wall_s']:.0f} s); ms a token {r['ms_per_decode_token']}", flush=True)
        return r

    t0 = time.perf_counter()
    static_plan, static_placement = solved_plan(a, traffic.statistics("A", []))
    out["profile_s"] = round(time.perf_counter() - t0, 1)
    if a.unshifted:
        return unshifted(a, static_plan, measure, out)
    with engine(a, "static", static_plan, "off") as eng:
        out["static_a"] = measure(eng, "static", "A", "measure", a.measure)
        out["static_b"] = measure(eng, "static", "B", "measure", a.measure, served_b)
    oracle_plan, oracle_placement = solved_plan(a, traffic.statistics("B", served_b))
    with engine(a, "oracle", oracle_plan, "off") as eng:
        out["oracle_b"] = measure(eng, "oracle", "B", "measure", a.measure)
    with engine(a, "replaced", static_plan, "on") as eng:
        out["replaced_a"] = measure(eng, "replaced", "A", "measure", a.measure)
        measure(eng, "replaced", "B", "after the shift", a.after)  # B's traffic from here on
        out["settled"] = settle(eng)
        out["replaced_b"] = measure(eng, "replaced", "B", "measure", a.measure)
    with engine(a, "oracle", oracle_plan, "off") as eng:  # again: brackets the replaced engine's B
        out["oracle_b_last"] = measure(eng, "oracle", "B", "measure (last engine)", a.measure)
    with engine(a, "static", static_plan, "off") as eng:  # again, last: brackets its A
        out["static_a_last"] = measure(eng, "static", "A", "measure (last engine)", a.measure)
    s, r, o = out["static_b"], out["replaced_b"], out["oracle_b"]
    static_a = (out["static_a"]["decode_tok_s"] + out["static_a_last"]["decode_tok_s"]) / 2
    oracle_b = (o["decode_tok_s"] + out["oracle_b_last"]["decode_tok_s"]) / 2
    out["summary"] = {
        "gpu_share_static": s["gpu_share"], "gpu_share_replaced": r["gpu_share"], "gpu_share_oracle": o["gpu_share"],
        "decode_tok_s_static": s["decode_tok_s"], "decode_tok_s_replaced": r["decode_tok_s"],
        "decode_tok_s_oracle": oracle_b, "speedup_vs_static": r["decode_tok_s"] / s["decode_tok_s"],
        "replaced_vs_oracle": r["decode_tok_s"] / oracle_b,
        "replaced_vs_oracle_first": r["decode_tok_s"] / o["decode_tok_s"],
        "oracle_b_drift": out["oracle_b_last"]["decode_tok_s"] / o["decode_tok_s"],
        "unshifted_ratio": out["replaced_a"]["decode_tok_s"] / static_a,
        "unshifted_ratio_first": out["replaced_a"]["decode_tok_s"] / out["static_a"]["decode_tok_s"],
        "static_a_drift": out["static_a_last"]["decode_tok_s"] / out["static_a"]["decode_tok_s"],
        "gpu_share_static_a": out["static_a"]["gpu_share"], "gpu_share_replaced_a": out["replaced_a"]["gpu_share"],
        # what the ILP expects of each split on its own statistics, and the layers' GPU neurons
        "ilp_share_static": static_placement.gpu_share, "ilp_share_oracle": oracle_placement.gpu_share,
        "gpu_neurons_static": [int(m.sum()) for m in static_placement.gpu_neurons],
        "gpu_neurons_oracle": [int(m.sum()) for m in oracle_placement.gpu_neurons],
        "replacement": r["replacement"], "settled_before_measure": out.get("settled"),
    }
    return out


def unshifted(a: argparse.Namespace, plan: Any, measure: Any, out: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
    """--unshifted N: the unshifted case alone (the module's docstring), N rounds of three engines on A."""
    kinds = [("static", "off", a.interval), ("replaced", "on", a.interval), ("idle", "on", NEVER)]
    rates: dict[str, list[float]] = {k[0]: [] for k in kinds}
    for i in range(a.unshifted):
        order = kinds[i % 3:] + kinds[:i % 3]
        for name, mode, interval in order[::-1] if i % 2 else order:
            with engine(a, name, plan, mode, interval) as eng:
                rates[name].append(measure(eng, name, "A", f"measure, round {i + 1}", a.measure)["decode_tok_s"])
    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    out["summary"] = {"unshifted_ratio": mean["replaced"] / mean["static"], "idle_ratio": mean["idle"] / mean["static"],
                      **{f"decode_tok_s_{k}_a": v for k, v in rates.items()},
                      "replacement": [r for r in out["records"] if r["engine"] == "replaced"][-1]["replacement"]}
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/replacement_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF file or planted:<preset>?...&ranges=2 "
                    "(default: the embedded model)")
    ap.add_argument("--as-file", default=None, metavar="DIR", help="planted models: run from DIR/<name>.gguf")
    ap.add_argument("--vram-budget", type=float, default=None,
                    help="GiB (default: the fixed parts and a third of the FFN's bytes)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU executor threads")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (text: window length)")
    ap.add_argument("--output", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--measure", type=int, default=1024, help="served tokens per measurement")
    ap.add_argument("--after", type=int, default=2000, help="served tokens of B before the re-placed engine's measurement")
    ap.add_argument("--interval", type=int, default=256, help="replacement_interval")
    ap.add_argument("--threshold", type=float, default=EngineConfig.replacement_threshold, help="replacement_threshold")
    ap.add_argument("--unshifted", type=int, default=0, metavar="N",
                    help="the unshifted case alone: N pairs of engines (static and re-placed, ABBA) serving A in turn")
    ap.add_argument("--profile-corpus", default="builtin:pydoc:train", help="text A (model files)")
    ap.add_argument("--serve-corpus", default="builtin:stdlib:train", help="text B (model files)")
    ap.add_argument("--profile-tokens", type=int, default=8192, help="tokens of A profiled")
    ap.add_argument("--sync-us", type=float, default=None,
                    help="the host profile's per-layer sync in us (default: the engine's host profile); 0 lets the "
                         "ILP split the tiny model's layers, whose 2 KB neurons never pay for a 45 us sync")
    ap.add_argument("--num-cpus", type=int, default=None, help="Ray CPUs (default: all)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.model is None:
        from powerinfer_ray.model.default import default_model_path

        a.model = str(default_model_path())
    if a.model.startswith("planted:") and "ranges=2" not in a.model:
        raise ValueError(f"-m {a.model}: a planted model needs ranges=2 (a hot set per token range) to shift")
    model_source(a)
    a.host_profile = None
    if a.sync_us is not None:
        from powerinfer_ray.placement.host import HostProfile

        a.host_profile = str(Path(tempfile.mkdtemp(prefix="replacement-bench-")) / "host.json")
        HostProfile(sync_us=a.sync_us).save(a.host_profile)
    if a.vram_budget is None:
        from powerinfer_ray.model.costs import model_costs
        from powerinfer_ray.model.source import open_model

        c = model_costs(open_model(a.model), a.prompt + a.output + 8, a.batch)
        a.vram_budget = (c.min_budget_bytes(False) + c.ffn_bytes / 3) / GIB
    from powerinfer_ray.generate import init_ray

    init_ray(num_cpus=a.num_cpus)
    name = a.name or f"replacement-{Path(a.model).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = run(a)
    settings = {k: getattr(a, k) for k in ("vram_budget", "threads", "batch", "prompt", "output", "measure", "after",
                                           "interval", "threshold", "sync_us", "profile_tokens", "unshifted")}
    traffic = ({"A": "token range A (ids below n_vocab / 2)", "B": "token range B"} if a.planted else
               {"A": a.profile_corpus, "B": a.serve_corpus})
    write_results(a.out_dir, name, "python bench/replacement_bench.py " + " ".join(argv), model=a.model,
                  planted=a.planted, traffic=traffic, settings=settings, **out["summary"],
                  records=out["records"], profile_s=out["profile_s"])
    print(json.dumps({k: v for k, v in out["summary"].items() if k != "replacement"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
