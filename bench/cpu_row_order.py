"""The CPU kernel on a planted model's rows in two orders: by neuron id (as the shard was before)
and hottest first (`Plan.hot_first`, the runtime's default), with active sets drawn from the
planted statistics, as the CPU executor's answer computes them (`sparse_ffn_bitmask`, T = 1, x in
the channel's dtype). Layers rotate call by call, orders interleaved, so the rows come from DRAM.

    python bench/cpu_row_order.py -m "planted:falcon-40b?dtype=f16&layers=8" -t 14 --out-dir bench/results

Writes <out-dir>/<name>.json (machine, commit, command, medians) when --out-dir is given.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import write_results  # noqa: E402

from powerinfer_ray.kernels import cpu_ffn  # noqa: E402
from powerinfer_ray.model.source import open_model  # noqa: E402
from powerinfer_ray.runtime.channel import pack_mask  # noqa: E402
from powerinfer_ray.runtime.config import activation_counts  # noqa: E402
from powerinfer_ray.runtime.plan import Plan  # noqa: E402
from powerinfer_ray.runtime.shard import load_ffn_shard  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="planted:falcon-40b?dtype=f16&layers=2")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=200, help="timed calls per order")
    ap.add_argument("--masks", type=int, default=16, help="active sets drawn per layer")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--name", default="cpu-row-order")
    a = ap.parse_args(argv)
    threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    src = open_model(a.model)
    cfg = src.config
    stats = activation_counts(src, a.model)
    if stats is None:
        raise SystemExit(f"{a.model}: no activation statistics (a planted model or a profiled file is needed)")
    counts, n_tok = stats
    ids = np.arange(cfg.n_ff)
    plan = Plan.all_cpu(cfg).hot_first(counts)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[cfg.dtype]
    rng = np.random.default_rng(0)
    shards, masks = {"id": [], "hot": []}, {"id": [], "hot": []}
    for l in range(cfg.n_layer):
        sh = load_ffn_shard(src, l, ids, dtype, torch.device("cpu"))
        hot = plan[l].cpu_neurons  # the runtime's order for an all-CPU layer
        t_hot = torch.from_numpy(hot)
        shards["id"].append(sh)
        shards["hot"].append(type(sh)(hot, sh.up[t_hot], None if sh.gate is None else sh.gate[t_hot],
                                      sh.down_t[t_hot], None if sh.up_bias is None else sh.up_bias[t_hot]))
        drawn = [rng.random(cfg.n_ff) < counts[l] / n_tok for _ in range(a.masks)]
        for order, perm in (("id", ids), ("hot", hot)):
            masks[order].append([pack_mask(torch.from_numpy(m[perm][None])).numpy() for m in drawn])
        print(f"layer {l}: {int(np.mean([m.sum() for m in drawn]))} active rows of {cfg.n_ff} on average", flush=True)
    x = torch.randn(1, cfg.n_embd, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = {o: torch.empty(1, cfg.n_embd, dtype=dtype) for o in shards}
    times: dict[str, list[float]] = {o: [] for o in shards}
    for i in range(a.calls + 10):
        l, k = i % cfg.n_layer, (i // cfg.n_layer) % a.masks
        for order in (("id", "hot") if i % 2 else ("hot", "id")):
            sh = shards[order][l]
            t0 = time.perf_counter()
            cpu_ffn.sparse_ffn_bitmask(x, sh.up, sh.gate, sh.down_t, masks[order][l][k], cfg.n_ff, cfg.ffn_act,
                                       sh.up_bias, out[order], threads)
            if i >= 10:
                times[order].append(time.perf_counter() - t0)
    torch.testing.assert_close(out["id"].float(), out["hot"].float(), rtol=2e-2, atol=2e-2)  # same rows, same sum
    res = {o: round(statistics.median(ts) * 1e6, 1) for o, ts in times.items()}
    print(f"[row order] {a.model} t={threads}: kernel median by id {res['id']} us, hottest first {res['hot']} us "
          f"(x{res['id'] / res['hot']:.2f})", flush=True)
    if a.out_dir:
        write_results(a.out_dir, a.name, "python bench/cpu_row_order.py " + " ".join(argv or sys.argv[1:]),
                      model=a.model, threads=threads, calls=a.calls, median_us=res,
                      p10_us={o: round(sorted(ts)[len(ts) // 10] * 1e6, 1) for o, ts in times.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
