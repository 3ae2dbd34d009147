"""Prefill's row stream alone: the CPU shard's rows gathered by the GPU out of a page-locked file
mapping on tmpfs, as ``runtime.cold.ColdRows.fill`` does, by each way of doing it.

    python bench/gather_bench.py --out-dir bench/results --name gather-13b-h200

A file of ``--layers`` layers' up / gate / down_t matrices ([n_ff, D] rows each: fp16, or Q4_0
blocks' bytes with --row-bytes) is written on /dev/shm, mapped read-only and page-locked in place
(read-only cudaHostRegister, as the runtime does). Each layer's CPU shard is a random ``--share``
of its rows in a random order (the plan's hottest-first order is a permutation of the file's).
One fill is ``--chunk-mb`` of rows (the runtime's stream buffer) out of the three matrices of a
layer into device buffers; timed by CUDA events over every layer's fills, median of --reps:

- ``index_select``: torch.index_select over the rows as 8-byte words (the runtime's gather);
- ``copy_ceiling``: the same bytes as one contiguous copy per matrix (the copy engine, no gather).

Every gather is checked against the host's own index_select.
"""
from __future__ import annotations

import argparse
import mmap
import os
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from model_bench import write_results
    from powerinfer_ray.runtime.channel import device_view, pin_host

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-ff", type=int, default=13824)
    p.add_argument("--row-bytes", type=int, default=10240, help="bytes a row (13B fp16: 10240; Q4_0: 2880)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--share", type=float, default=0.6, help="of a layer's rows on the CPU")
    p.add_argument("--chunk-mb", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="gather")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gather_bench needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    n, rb, L = a.n_ff, a.row_bytes, a.layers
    mat = n * rb
    path = Path(a.dir) / f"gather-bench-{os.getpid()}.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:  # 3 matrices a layer
        block = rng.integers(0, 256, size=mat, dtype=np.uint8).tobytes()
        for _ in range(3 * L):
            f.write(block)
    try:
        fd = os.open(path, os.O_RDONLY)
        mm = mmap.mmap(fd, 3 * L * mat, prot=mmap.PROT_READ)
        os.close(fd)
        host = np.frombuffer(mm, dtype=np.uint8)
        addr = host.ctypes.data
        assert pin_host(addr, 3 * L * mat, "gather bench file", read_only=True), "cudaHostRegister failed"
        mats = [[torch.from_numpy(host[(3 * l + m) * mat:(3 * l + m + 1) * mat]).view(n, rb) for m in range(3)]
                for l in range(L)]
        k = int(n * a.share)
        shards = [torch.from_numpy(rng.permutation(n)[:k].astype(np.int64)) for _ in range(L)]
        per = max(1, min(k, (a.chunk_mb << 20) // (3 * rb)))  # rows a fill
        bufs = [torch.empty(per, rb, dtype=torch.uint8, device=dev) for _ in range(3)]
        dviews = [[device_view(t) for t in ms] for ms in mats]
        idx_dev = [s.to(dev) for s in shards]
        wide = 8 if rb % 8 == 0 else 4

        def fills(how: str) -> None:
            for l in range(L):
                for a0 in range(0, k, per):
                    b0 = min(k, a0 + per)
                    for m in range(3):
                        out, src, idx = bufs[m][:b0 - a0], dviews[l][m], idx_dev[l][a0:b0]
                        if how == "index_select":
                            torch.index_select(src.view(torch.int64 if wide == 8 else torch.int32), 0, idx,
                                               out=out.view(torch.int64 if wide == 8 else torch.int32))
                        else:  # the same bytes, contiguous
                            out.copy_(mats[l][m][a0:b0], non_blocking=True)

        nbytes = 3 * L * k * rb
        records = []
        for how in ("index_select", "copy_ceiling"):
            fills(how)
            torch.cuda.synchronize()
            if how != "copy_ceiling":  # the last fill's rows against the host's gather
                l, a0 = L - 1, (k - 1) // per * per
                for m in range(3):
                    want = mats[l][m].index_select(0, shards[l][a0:k])
                    assert torch.equal(bufs[m][:k - a0].cpu(), want), f"{how}: wrong rows"
            ts = []
            for _ in range(a.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fills(how)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3)
            s = statistics.median(ts)
            records.append({"how": how, "bytes": nbytes, "seconds_median": s, "gbps_median": nbytes / s / 1e9,
                            "gbps_max": nbytes / min(ts) / 1e9, "rows_a_fill": per, "row_bytes": rb})
            print(f"{how}: {nbytes / s / 1e9:.1f} GB/s ({nbytes / 1e9:.2f} GB in {s * 1e3:.1f} ms, median of {a.reps})",
                  flush=True)
        torch.cuda.cudart().cudaHostUnregister(addr)
    finally:
        path.unlink(missing_ok=True)
    write_results(a.out_dir, a.name, "python bench/gather_bench.py " + shlex.join(sys.argv[1:]),
                  n_ff=n, layers=L, share=a.share, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
