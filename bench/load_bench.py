"""Weights from a model file's memory map to the GPU: the ways the GPU executor could copy them.

    python bench/load_bench.py /dev/shm/llama2-13b-f16.gguf --gib 6 --out-dir bench/results --name load-13b-h200

The GPU executor copies synchronously from pageable, freshly mapped pages, one layer after
another (its record's ``executor_phases_s`` gives the seconds by kind). This measures the
alternatives on the same kinds of tensors: the first layers' attention matrices (contiguous) and
a random 60 % of their FFN rows (gathered), up to --gib of each. Every method runs in a fresh process, so each maps the file's
pages anew, as an executor does:

- ``pageable``: ``view.to("cuda")`` / ``view.index_select(0, ids).to("cuda")`` (today);
- ``staged``: through two pinned buffers (--stage-mib each): the host copies (or gathers, with
  ``index_select(out=...)``) into one while the other's copy to the GPU runs;
- ``threads``: today's copies from --threads Python threads, one tensor each at a time.

One record per (method, kind): GB/s over the bytes that reach the GPU, and seconds.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("pageable", "staged", "threads")
KINDS = ("contiguous", "gathered")
GATHER_SHARE = 0.6  # of a layer's FFN rows: about what the GPU holds of a 13B at 16 GiB


def pieces(path: str, gib: float, kind: str, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(view, row ids or None) of the file's tensors up to ``gib``: attention matrices whole, or
    FFN matrices' random rows (the same rows of up / gate / down_t of a layer)."""
    from powerinfer_ray.model import gguf_keys as K
    from powerinfer_ray.model.source import mapped_tensor, open_model

    src = open_model(path)
    cfg, budget, out = src.config, gib * 2**30, []
    rng = np.random.default_rng(seed)
    for l in range(cfg.n_layer):
        if kind == "contiguous":
            names = [K.tensor(t, l) for t in (K.ATTN_Q, K.ATTN_K, K.ATTN_V, K.ATTN_OUT)]
            ids = None
        else:
            names = [K.tensor(t, l) for t in (K.FFN_UP, K.FFN_GATE, K.FFN_DOWN_T)]
            ids = torch.from_numpy(np.sort(rng.choice(cfg.n_ff, int(GATHER_SHARE * cfg.n_ff), replace=False)))
        for name in names:
            v = mapped_tensor(src, name)
            if v is None:
                continue
            out.append((v, ids))
            budget -= (v.shape[0] if ids is None else len(ids)) * v[0].numel() * v.element_size()
            if budget <= 0:
                return out
    return out


def pageable(views: list, dev: torch.device) -> list[torch.Tensor]:
    return [(v if ids is None else v.index_select(0, ids)).to(dev) for v, ids in views]


def staged(views: list, dev: torch.device, stage_bytes: int) -> list[torch.Tensor]:
    cuda = dev.type == "cuda"  # elsewhere (a dry run of the chunking) unpinned, without events
    bufs = [torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    i, out = 0, []
    for v, ids in views:
        n = v.shape[0] if ids is None else len(ids)
        row = v[0].numel() * v.element_size()
        dst = torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=dev)
        per = max(1, stage_bytes // row)
        for a in range(0, n, per):
            b = min(n, a + per)
            if done[i] is not None:
                done[i].synchronize()  # this buffer's last copy to the GPU has finished
            host = bufs[i][: (b - a) * row].view(v.dtype).view(b - a, *v.shape[1:])
            if ids is None:
                host.copy_(v[a:b])
            else:
                torch.index_select(v, 0, ids[a:b], out=host)
            dst[a:b].copy_(host, non_blocking=cuda)
            if cuda:
                done[i] = torch.cuda.Event()
                done[i].record()
            i ^= 1
        out.append(dst)
    return out


def threaded(views: list, dev: torch.device, threads: int) -> list[torch.Tensor]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda p: pageable([p], dev)[0], views))


def one(a: argparse.Namespace) -> dict:
    """This process's measurement: one method on one kind of tensors."""
    torch.set_num_threads(a.torch_threads)
    dev = torch.device("cuda")
    torch.empty(1, device=dev)  # the context, outside the timing
    views = pieces(a.model, a.gib, a.kind)
    t0 = time.perf_counter()
    if a.method == "pageable":
        out = pageable(views, dev)
    elif a.method == "staged":
        out = staged(views, dev, a.stage_mib << 20)
    else:
        out = threaded(views, dev, a.threads)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in out)
    return {"method": a.method, "kind": a.kind, "bytes": nbytes, "seconds": s, "gbps": nbytes / s / 1e9,
            "tensors": len(out), "torch_threads": a.torch_threads, "threads": a.threads if a.method == "threads" else 1,
            "stage_mib": a.stage_mib if a.method == "staged" else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a GGUF file (on /dev/shm for the executor's case)")
    p.add_argument("--gib", type=float, default=6.0, help="GiB of each kind of tensors")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--stage-mib", type=int, default=64, help="each of the two pinned buffers")
    p.add_argument("--threads", type=int, default=4, help="the threads method's Python threads")
    p.add_argument("--torch-threads", type=int, default=8, help="torch's threads (gathers, host copies)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="load")
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)  # one measurement, in a child
    p.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.method:
        print(json.dumps(one(a)))
        return 0
    if not torch.cuda.is_available():
        print("load_bench measures copies to a CUDA device: no GPU here", file=sys.stderr)
        return 2
    from model_bench import write_results

    records = []
    for method in a.methods.split(","):
        if method not in METHODS:
            p.error(f"--methods: {method!r} is not one of {', '.join(METHODS)}")
        for kind in KINDS:
            argv = [sys.executable, __file__, a.model, "--gib", str(a.gib), "--stage-mib", str(a.stage_mib),
                    "--threads", str(a.threads), "--torch-threads", str(a.torch_threads),
                    "--method", method, "--kind", kind]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                print(f"{method} {kind} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            rec = json.loads(r.stdout.strip().splitlines()[-1])
            records.append(rec)
            print(f"{method:9s} {kind:10s} {rec['bytes'] / 2**30:.2f} GiB in {rec['seconds']:.2f} s = "
                  f"{rec['gbps']:.1f} GB/s", flush=True)
    write_results(a.out_dir, a.name, "python bench/load_bench.py " + shlex.join(sys.argv[1:]), model=a.model,
                  records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
