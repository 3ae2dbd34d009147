"""Benchmark of the neuron-aware sparse FFN against torch gather + matmul, with roofline numbers.

Shape: Llama-2-13B FFN (D = 5120, N = 13824), ReGLU; weights fp16, q4_0 and q8_0 on the GPU
(Triton), fp16, fp32, q4_0 and q8_0 on the CPU (compiled kernel); densities 1, 5, 10, 20, 50 %;
T = 1 and 8. Reported per case: median time, achieved GB/s on the ACTIVE bytes (3 x K x row bytes:
each active row of up, gate and down_t read once; for q4_0 / q8_0 the compressed bytes), the
fraction of the ceiling measured in the same run (GPU: a device-to-device copy, bytes read +
written; CPU: a multi-threaded read with the kernel's threads), and the torch gather + matmul
baseline measured in the same run (quantized rows: gathered, dequantized, multiplied). The GPU
part also times the dense GEMV on quantized rows (kernels.linear) at the attention, output-head
and predictor shapes.

Data: x and gate rows are positive, so relu(gate . x) > 0 and every active neuron has a nonzero
activation: the kernels' skip of zero-activation down rows never triggers, every active byte is
read. Index sets are random and rotate (8 sets) and GPU timings flush L2 between calls
(triton.testing.do_bench), so neither cache holds the active rows.

Usage: python bench/kernels_bench.py [--device auto|cpu|cuda] [--out DIR] [--sweep] [--quick]
(`powerinfer-ray bench kernels` calls main(argv)). Writes DIR/kernels-<machine>.json.

--cpu-exchange runs only the CPU executor's per-layer exchange section (see bench_cpu_exchange) and
writes DIR/kernels-exchange-<machine>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

try:
    from powerinfer_ray import kernels as K
    from powerinfer_ray.kernels import cpu_ffn, cpu_library, quant
except ImportError:  # a plain checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kernels as K  # type: ignore[no-redef]
    from kernels import cpu_ffn, cpu_library, quant  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the drivers share model_bench's helpers
from model_bench import commit, settings  # noqa: E402

D, N = 5120, 13824
GPU = "cuda"  # the device of the GPU part (a CPU harness may point it elsewhere)
COPY_BYTES = 1 << 30  # the D2D ceiling copy
FLUSH_BYTES = 1 << 30  # CPU: read between timed calls, larger than any L3 seen (300 MiB)
N_SETS = 8  # rotating index sets per case
RESULTS = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="powerinfer-ray bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPU (if any) and the CPU; cpu / cuda: only that one")
    p.add_argument("--densities", default="1,5,10,20,50", help="percent of active neurons, comma-separated")
    p.add_argument("--tokens", default="1,8", help="T values, comma-separated")
    p.add_argument("--cpu-dtypes", default="fp16,fp32,q4_0,q8_0", help="weights: fp16, fp32, bf16, q4_0, q8_0")
    p.add_argument("--gpu-dtypes", default="fp16,q4_0,q8_0", help="weights: fp16, bf16, fp32, q4_0, q8_0")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default torch.get_num_threads())")
    p.add_argument("--sweep", action="store_true", help="GPU: sweep Triton tile configs first, use the best")
    p.add_argument("--order", choices=["random", "sorted"], default="random",
                   help="order of the active rows: random (the default, as before), or ascending as the runtime's masks decode")
    p.add_argument("--seq-layers", type=int, default=16,
                   help="GPU: also time each case inside one CUDA graph of this many layers, each with its "
                        "own weight copy (per-layer time, as the runtime's decode graph runs it); 0: off")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    p.add_argument("--budget", type=float, default=1.0, help="CPU: seconds of repetitions per measurement")
    p.add_argument("--out", default=str(RESULTS), help="directory of the JSON result")
    p.add_argument("--machine", default=None, help="name in the result file (default: from the hardware)")
    p.add_argument("--commit", default=None, help="commit measured (default: $POWERINFER_COMMIT, else git)")
    p.add_argument("--cpu-exchange", action="store_true",
                   help="only the CPU executor's exchange (packed mask -> y), OMP_WAIT_POLICY unset vs ACTIVE")
    p.add_argument("--exchange-k", default="64,160,320", help="--cpu-exchange: active rows K, comma-separated")
    p.add_argument("--exchange-reps", type=int, default=300, help="--cpu-exchange: timed calls per variant")
    p.add_argument("--exchange-rounds", type=int, default=1,
                   help="--cpu-exchange: run every (build, policy) worker this many times, in ABBA order (every "
                        "other round reversed), each with reps / rounds calls; rows report the median of the rounds' "
                        "medians, so drift over the run does not favour the build that ran first")
    p.add_argument("--exchange-gap-ms", type=float, default=1.0,
                   help="--cpu-exchange: sleep between calls (the layer cadence: OpenMP workers may fall asleep)")
    p.add_argument("--exchange-layers", type=int, default=1,
                   help="--cpu-exchange: > 1 rotates over this many layers' CPU shards (40 x 264 MB: the "
                        "runtime's cold working set, beyond any L3): sparse_ffn_bitmask per work split only")
    p.add_argument("--exchange-cflags", default=None,
                   help="--cpu-exchange: ';'-separated kernel builds to compare (extra compiler flags of "
                        "cpu_library.select_build each, '' = the default), e.g. ';-mno-avx512f' (a value starting "
                        "with '-' needs '=': --exchange-cflags=-mno-avx512f;); one worker process per build and policy")
    p.add_argument("--exchange-act", choices=["reglu", "relu"], default="reglu",
                   help="--cpu-exchange with --exchange-layers > 1: the FFN (relu: no gate, as OPT / Falcon)")
    p.add_argument("--exchange-dim", type=int, default=5120,
                   help="--cpu-exchange with --exchange-layers > 1: row length D (Falcon-40B: 8192)")
    p.add_argument("--exchange-n", type=int, default=None,
                   help="--cpu-exchange with --exchange-layers > 1: rows per layer's shard (default 8600, the "
                        "13B CPU shard; Falcon-40B at 24 GiB: ~31000)")
    p.add_argument("--exchange-dtype", choices=["fp16", "q4_0", "q8_0"], default="fp16",
                   help="--cpu-exchange with --exchange-layers > 1: the shards' weights (quantized: random blocks)")
    p.add_argument("--exchange-shm", action="store_true",
                   help="--cpu-exchange with --exchange-layers > 1: the shards in one /dev/shm file (tmpfs pages, "
                        "as a model file on /dev/shm or the runtime's shared copy), instead of private memory")
    p.add_argument("--exchange-policies", default=",".join(EX_POLICIES),
                   help="--cpu-exchange: OMP_WAIT_POLICY values, one worker process each ('unset': not set; "
                        "it reaches torch's threads only: the kernels run on their own, csrc/pool.h)")
    p.add_argument("--pool-spin-us", type=int, default=None,
                   help="--cpu-exchange: microseconds the kernels' worker threads spin after a call before sleeping "
                        "(default: the CPU executor's, runtime.cpu_executor.WORKER_SPIN_US)")
    p.add_argument("--pool-pin", action="store_true",
                   help="--cpu-exchange: pin the caller and the kernels' workers to the last -t CPUs (as the CPU "
                        "executor does when two CPUs are left over)")
    p.add_argument("--exchange-worker", default=None, help=argparse.SUPPRESS)  # internal: JSON path of one worker
    p.add_argument("--exchange-build", default=None, help=argparse.SUPPRESS)  # internal: the worker's cflags
    return p.parse_args(argv)


DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}
QTYPES = ("q4_0", "q8_0")  # ggml blocks: GB/s are reported on the compressed bytes


def machine_name() -> str:
    if torch.cuda.is_available():
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return f"cpu-{os.cpu_count()}c"


def make_weights(dtype: torch.dtype, device: str, gen: torch.Generator):
    """up (any sign), gate (positive), down_t; 1/sqrt(D) scale keeps fp16 in range."""
    def r(pos: bool) -> torch.Tensor:
        w = torch.randn(N, D, generator=gen, dtype=torch.float32)
        return (w.abs() if pos else w).mul_(D ** -0.5).to(dtype).to(device)

    return r(False), r(True), r(False)


def make_qweights(qtype: str, device: str, gen: torch.Generator, n: int = N, d: int = D):
    """make_weights as random ggml blocks of qtype (uint8 [n, d // 32 * block bytes]): random
    integers, scales of ~1/sqrt(d) per weight; gate's values >= 0 (q8_0 q in 0..127, q4_0 nibbles
    >= 8), so with x > 0 every active neuron's activation is nonzero."""
    bb, nb = quant.BLOCK_BYTES[qtype], d // quant.QK
    scale = torch.full((n, nb, 1), d ** -0.5 / (64 if qtype == "q8_0" else 4), dtype=torch.float16)

    def r(pos: bool) -> torch.Tensor:
        b = torch.randint(0, 256, (n, nb, bb), generator=gen, dtype=torch.uint8)
        if pos:
            b[..., 2:] = b[..., 2:] & 0x7F if qtype == "q8_0" else b[..., 2:] | 0x88
        b[..., :2] = scale.view(torch.uint8)
        return b.reshape(n, nb * bb).to(device)

    return r(False), r(True), r(False)


def weights(dtype: str, device: str, gen: torch.Generator):
    return make_qweights(dtype, device, gen) if dtype in QTYPES else make_weights(DTYPES[dtype], device, gen)


def idx_sets(density: float, device: str, gen: torch.Generator, order: str = "random") -> tuple[int, list[torch.Tensor]]:
    """N_SETS sets of k active rows: in random order, or ascending (order='sorted': as the runtime's
    masks decode, on the CPU executor and from the GPU's split kernel)."""
    k = max(1, round(density * N))
    sets = [torch.randperm(N, generator=gen)[:k] for _ in range(N_SETS)]
    if order == "sorted":
        sets = [s.sort().values for s in sets]
    return k, [s.to(torch.int32).to(device) for s in sets]


def torch_baseline(x, up, gate, down_t, idx, qtype=None):
    """torch gather + matmul in the weights' dtype (quantized: gather, dequantize to x's dtype):
    what the kernels replace."""
    rows = idx.long()
    w = [r if qtype is None else quant.dequantize(r, qtype, x.dtype) for r in (up[rows], gate[rows], down_t[rows])]
    u = w[0] @ x.T  # [K, T]
    g = w[1] @ x.T  # [K, T]
    h = torch.relu(g) * u
    return h.T @ w[2]  # [T, D]


def median_times_cpu(fns, reps: int, budget_s: float, flush=None) -> list[tuple[float, float]]:
    """(median, min) wall seconds of each fn over up to reps rounds (after one warm-up) within
    budget_s. A round calls every fn once, flush() untimed before each, so the kernel and its
    baseline see the same machine load; the min is reported beside the median because shared
    machines preempt threads (a preempted thread stalls a parallel region's barrier)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    t_end = time.perf_counter() + budget_s
    while len(times[0]) < reps and (len(times[0]) < 3 or time.perf_counter() < t_end):
        for fn, ts in zip(fns, times):
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [(statistics.median(ts), min(ts)) for ts in times]


def cpu_flusher(threads: int, nbytes: int = FLUSH_BYTES):
    """A callable that streams nbytes through the caches (evicts the weights' rows from L3)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    lib = cpu_library.library()
    return lambda: lib.pi_read_sum(buf.data_ptr(), buf.numel(), threads)


def read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, reps: int = 5, method: str = "sum") -> float:
    """Multi-threaded DRAM read rate in GB/s (median of reps) with the kernel's threads: the CPU
    ceiling the benchmark reports fractions of. method 'sum': a sum over an fp32 buffer, each
    thread a fixed quarter of it in four streams; 'linear': the dense rows of an fp16 matrix
    through `pi_linear` (x of one token, rows split over the same threads). The benchmark takes the
    larger of the two."""
    if method not in ("sum", "linear"):
        raise ValueError(f"method={method!r}: expected 'sum' or 'linear'")
    lib = cpu_library.library()
    nthreads = int(threads or torch.get_num_threads())
    if method == "sum":
        buf = torch.ones(nbytes // 4, dtype=torch.float32)

        def call() -> None:
            lib.pi_read_sum(buf.data_ptr(), buf.numel(), nthreads)
    else:
        w = torch.ones(max(1, nbytes // (2 * 4096)), 4096, dtype=torch.float16)
        x = torch.ones(1, 4096)

        def call() -> None:
            cpu_ffn.linear(x, w, threads=nthreads)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return nbytes / times[len(times) // 2] / 1e9


def row_bytes(dtype: str) -> int:
    """Bytes of one weight row of D columns: the compressed bytes for q4_0 / q8_0."""
    if dtype in QTYPES:
        return quant.row_bytes(dtype, D)
    return D * torch.tensor([], dtype=DTYPES[dtype]).element_size()


def record(device, backend, dtype, T, density, k, t_kernel, t_base, ceiling, extra=None) -> dict:
    nbytes = 3 * k * row_bytes(dtype)
    gbps, base_gbps = nbytes / t_kernel / 1e9, nbytes / t_base / 1e9
    row = dict(device=device, backend=backend, dtype=dtype, T=T, density=density, K=k, active_bytes=nbytes,
               median_us=round(t_kernel * 1e6, 2), GBps=round(gbps, 2), frac_ceiling=round(gbps / ceiling, 4),
               baseline_median_us=round(t_base * 1e6, 2), baseline_GBps=round(base_gbps, 2),
               speedup_vs_baseline=round(t_base / t_kernel, 2))
    row.update(extra or {})
    return row


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
def bench_cpu(args) -> dict:
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    if not cpu_library.available():
        return {"error": "compiled CPU kernel unavailable (no compiler); nothing measured"}
    reads = {m: max(read_bandwidth(1 << 30, threads, reps=5, method=m) for _ in range(3))
             for m in ("sum", "linear")}  # best of 3 medians each
    ceiling = max(reads.values())
    print(f"[cpu] {threads} threads, SIMD {cpu_library.simd_width()} lanes, read ceiling {ceiling:.1f} GB/s "
          f"(sum {reads['sum']:.1f}, dense linear {reads['linear']:.1f})", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    reps, budget = (5, 0.3) if args.quick else (30, args.budget)
    flush = cpu_flusher(threads)
    for dname in args.cpu_dtypes.split(","):
        qtype = dname if dname in QTYPES else None
        xdt = torch.float16 if qtype else DTYPES[dname]  # quantized weights: x and y in fp16, as the channel's
        up, gate, down_t = weights(dname, "cpu", gen)
        for T, pct in itertools.product(map(int, args.tokens.split(",")), map(float, args.densities.split(","))):
            k, sets = idx_sets(pct / 100, "cpu", gen, args.order)
            x = torch.randn(T, D, generator=gen).abs().to(xdt)
            out = torch.empty(T, D, dtype=xdt)
            cyc = itertools.cycle(sets)
            (t_k, m_k), (t_b, m_b) = median_times_cpu(
                [lambda: K.sparse_ffn(x, up, gate, down_t, next(cyc), out=out, backend="cpu", threads=threads,
                                      qtype=qtype),
                 lambda: torch_baseline(x.float() if qtype else x, up, gate, down_t, next(cyc), qtype)],
                reps, budget, flush)
            nb = 3 * k * row_bytes(dname)
            row = record("cpu", "compiled", dname, T, pct, k, t_k, t_b, ceiling,
                         dict(min_us=round(m_k * 1e6, 2), GBps_at_min=round(nb / m_k / 1e9, 2),
                              baseline_min_us=round(m_b * 1e6, 2)))
            rows.append(row)
            print(f"[cpu] {dname} T={T} {pct:g}%: {row['median_us']:.0f} us {row['GBps']:.1f} GB/s "
                  f"({row['frac_ceiling']:.0%} of ceiling; min {row['min_us']:.0f} us {row['GBps_at_min']:.1f} GB/s); "
                  f"torch {row['baseline_median_us']:.0f} us (min {row['baseline_min_us']:.0f}) "
                  f"-> x{row['speedup_vs_baseline']:.1f}", flush=True)
        del up, gate, down_t
    return dict(threads=threads, simd_lanes=cpu_library.simd_width(), quant_isa=cpu_library.library().pi_quant_isa(),
                ceiling_read_GBps=round(ceiling, 2),
                ceiling_reads_GBps={m: round(v, 2) for m, v in reads.items()},
                ceiling_method=("the larger of: a multi-threaded sum of a 1 GiB fp32 buffer with the kernel's "
                                "threads, 4 interleaved streams per thread; the dense rows of a 1 GiB fp16 "
                                "matrix through pi_linear (one token)"),
                timing=("median (and min) wall time per call; kernel and torch baseline timed in alternation; "
                        "a 1 GiB read flushes the caches before each timed call"),
                results=rows)


# ---------------------------------------------------------------------------------------------
# CPU executor exchange: packed uint8 mask (as the channel holds it) -> y [T, D]
# ---------------------------------------------------------------------------------------------
EX_N = 8600  # rows of the CPU shard (Llama-2-13B, ~60-65 % of 13824 neurons on the CPU)
EX_SET_BYTES = 96 << 20  # rotating masks cover at least this many active bytes (3x this L3): cold rows
EX_POLICIES = ("unset", "ACTIVE")


def exchange_masks(K: int, T: int, n: int, sets: int, gen: torch.Generator):
    """`sets` packed masks uint8 [T, ceil(n/8)] (channel layout: neuron j in bit j % 8 of byte j // 8),
    each with K rows active for at least one token; at T > 1 each token takes each of the K rows
    with probability 1/2 (rows no token took go to a random token)."""
    from powerinfer_ray.runtime.channel import pack_mask

    out = []
    for _ in range(sets):
        rows = torch.randperm(n, generator=gen)[:K]
        tok = torch.rand(T, K, generator=gen) < 0.5 if T > 1 else torch.ones(1, K, dtype=torch.bool)
        lone = ~tok.any(0)
        tok[torch.randint(T, (int(lone.sum()),), generator=gen), lone.nonzero().reshape(-1)] = True
        m = torch.zeros(T, n, dtype=torch.bool)
        m[:, rows] = tok
        out.append(pack_mask(m).numpy())
    return out


def _call_times(ts: list[float], nbytes: int | None) -> dict:
    """Median / p10 / p90 us of timed calls, and GB/s of nbytes at the median (None: not a read)."""
    med, srt = statistics.median(ts), sorted(ts)
    return dict(median_us=round(med * 1e6, 1), p10_us=round(srt[len(ts) // 10] * 1e6, 1),
                p90_us=round(srt[len(ts) * 9 // 10] * 1e6, 1),
                GBps=round(nbytes / med / 1e9, 2) if nbytes is not None else None)


def _worker_library(args):
    """The kernel build a worker process measures: --exchange-build's flags, else the default; its
    worker threads spin as the CPU executor's do (or --pool-spin-us)."""
    lib = cpu_library.select_build(args.exchange_build.split()) if args.exchange_build else cpu_library.library()
    if hasattr(cpu_library, "configure_threads"):  # (builds before the library's own threads had none)
        from powerinfer_ray.runtime.cpu_executor import WORKER_SPIN_US

        cpus = sorted(os.sched_getaffinity(0))[-(args.threads or os.cpu_count()):] if args.pool_pin else []
        cpu_library.configure_threads(WORKER_SPIN_US if args.pool_spin_us is None else args.pool_spin_us, cpus)
    return lib


def _exchange_worker(args) -> dict:
    """One process (OMP_WAIT_POLICY as inherited): median wall time per call of each variant, calls
    separated by args.exchange_gap_ms of sleep, variants interleaved call by call."""
    import ctypes  # noqa: F401  (the kernel's handle)

    import numpy as np

    from powerinfer_ray.runtime.channel import unpack_mask
    from powerinfer_ray.runtime.layers import active_rows, ffn_partial
    from powerinfer_ray.runtime.shard import FFNShard

    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    lib = _worker_library(args)
    gen = torch.Generator().manual_seed(2)
    up, gate, down_t = (w[:EX_N].contiguous() for w in make_weights(torch.float16, "cpu", gen))
    shard = FFNShard(np.arange(EX_N), up, gate, down_t, None)
    B = (EX_N + 7) // 8
    gap = args.exchange_gap_ms / 1e3
    reps = 20 if args.quick else args.exchange_reps
    rows_out = []
    for T, K in itertools.product(map(int, args.tokens.split(",")), map(int, args.exchange_k.split(","))):
        nsets = max(8, -(-EX_SET_BYTES // (3 * K * D * 2)))
        masks = exchange_masks(K, T, EX_N, nsets, gen)
        # channel-like buffers: x [T_max, D] fp16, out [T_max, D] fp32, mask [T_max, B] (views of rows :T)
        x_ch = torch.randn(8, D, generator=gen).abs().half()
        out_ch = torch.empty(8, D, dtype=torch.float32)
        m_ch = np.zeros((8, B), dtype=np.uint8)
        x, out = x_ch[:T], out_ch[:T]
        # the kernel alone: idx / mask / x decoded beforehand, as ffn_partial hands them to the kernel
        pre = []
        for m in masks:
            idx, tok = active_rows(unpack_mask(m, EX_N))
            pre.append((idx.contiguous(), None if tok is None else tok.contiguous()))
        xs = x.float().contiguous()
        splits = ("rows", "cols")
        nb = max(lib.pi_scratch_bytes(T, D, EX_N, threads, 0, cpu_ffn.SPLITS[sp], 0, 1) for sp in splits)
        scratch = torch.empty(nb, dtype=torch.uint8)  # bytes for the largest K of the sets, either split
        state = {"i": 0}

        def load():  # the next mask into the channel buffer (untimed)
            state["i"] = (state["i"] + 1) % nsets
            m_ch[:T] = masks[state["i"]]

        def old_path():  # CPUExecutor._compute before this change
            mask = unpack_mask(m_ch[:T, :(EX_N + 7) // 8], EX_N)
            ffn_partial(x.float(), shard, "reglu", "predictor", mask, out=out, threads=threads)

        def decode_only():  # its Python decoding alone: unpackbits + active_rows
            active_rows(unpack_mask(m_ch[:T, :(EX_N + 7) // 8], EX_N))

        def kernel_only(split):  # the ctypes call alone (mask mode bool [T, K], or none at T = 1)
            idx, tok = pre[state["i"]]
            rc = lib.pi_sparse_ffn(xs.data_ptr(), T, D, up.data_ptr(), gate.data_ptr(), down_t.data_ptr(), 1,
                                   D, D, D, EX_N, None, 0, idx.data_ptr(), 1, idx.numel(),
                                   None if tok is None else tok.data_ptr(), 0 if tok is None else 1,
                                   0 if tok is None else tok.shape[1], 1, out.data_ptr(), 0, scratch.data_ptr(),
                                   threads, cpu_ffn.SPLITS[split], 0.0, 0)
            assert rc == 0, rc

        tiny = torch.ones(16 * threads)

        def omp_region():  # a parallel region of the kernel's threads doing nothing: fork/join + wake-up
            lib.pi_read_sum(tiny.data_ptr(), tiny.numel(), threads)

        variants = {"exchange_ffn_partial": old_path, "decode_python": decode_only, "omp_region": omp_region}
        for sp in splits:
            variants[f"kernel_call_{sp}"] = lambda sp=sp: kernel_only(sp)
        exchange = cpu_ffn.prepare_bitmask(x, up, gate, down_t, m_ch[:T, :B], EX_N, "reglu", None, out)
        variants["exchange_bitmask"] = lambda: exchange(T, threads)
        times = {v: [] for v in variants}
        for v in variants.values():  # warm-up (the kernel's build, page faults)
            load()
            v()
        order = list(variants.items())
        rng = random.Random(T * 1000 + K)
        for _ in range(reps):
            rng.shuffle(order)  # a variant's time depends on what ran before it (caches): vary that
            for name, fn in order:
                load()
                time.sleep(gap)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        nbytes = 3 * K * D * 2
        for name, ts in times.items():
            rows_out.append(dict(variant=name, T=T, K=K,
                                 **_call_times(ts, None if name in ("decode_python", "omp_region") else nbytes)))
        print(f"[exchange {os.environ.get('OMP_WAIT_POLICY', 'unset')}] T={T} K={K}: " + ", ".join(
            f"{r['variant']} {r['median_us']:.0f} us" for r in rows_out[-len(times):]), flush=True)
    return dict(threads=threads, rows=rows_out)


def _exchange_cold(args) -> dict:
    """The CPU executor's answer (sparse_ffn_bitmask) when each call reads the next of L layers'
    shards, as the runtime does (40 layers: ~10 GB, cold in any cache), with the kernel's work
    split chosen (auto) and forced (rows / cols), variants interleaved call by call after a gap
    of sleep. Variant 'contiguous': the same bytes as K rows next to each other (the shard's first
    K, every one active: the dense path's access pattern), i.e. what the random placement of the
    active rows costs; 'omp_region': an empty parallel region of the kernel's threads after the same
    gap (their wake-up and fork / join); 'prepared_empty': the call as the CPU executor makes it (prepared
    once per layer) on a mask with no neuron set, the exchange's fixed cost. --exchange-shm: the shards live in
    one /dev/shm file as in the runtime, their pages mapped before the timing as the runtime's CPU
    executor maps its rows (sharedshard.prefault, runtime/warm.py); before 2026-12-06 they were not,
    and every random row paid minor page faults (dev machine, 1 thread, K = 250: 1835 us unmapped,
    534 mapped).
    (Huge pages for the shards were measured here too, commit 171befb: no gain cold, 2x slower in
    the runtime; bench/results/kernels-exchange-cold-h200.json.)"""
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    L, act, dim, n = args.exchange_layers, args.exchange_act, args.exchange_dim, args.exchange_n or EX_N
    gen = torch.Generator().manual_seed(2)
    qtype = args.exchange_dtype if args.exchange_dtype in QTYPES else None
    if qtype is None:
        base = [(torch.randn(n, dim, generator=gen) * dim ** -0.5).half() for _ in range(3)]
        base[1].abs_()  # gate positive: every active row's down row is read
        if act == "relu":
            base[0].abs_()  # ReLU of up positive likewise
    else:  # up, gate (values >= 0), down as random blocks
        base = list(make_qweights(qtype, "cpu", gen, n, dim))
        if act == "relu":
            base[0] = base[1]
    if act == "relu":
        base[1] = None
    row_width = dim if qtype is None else quant.row_bytes(qtype, dim)
    if args.exchange_shm:
        from powerinfer_ray.runtime.shard import FFNShard
        from powerinfer_ray.runtime.sharedshard import prefault, share

        ids = np.arange(n)
        shared = share([n] * L, act != "relu", row_width, base[0].dtype,
                       lambda l: FFNShard(ids, base[0], base[1], base[2], None, qtype), qtype=qtype)
        if shared is None:
            raise RuntimeError("--exchange-shm: /dev/shm has no room for the shards (see the warning above)")
        prefault(shared[0])  # mapped here, as the runtime's CPU executor maps its shared rows
        layers = [[sh.up, sh.gate, sh.down_t] for sh in shared[0]]
    else:
        layers = [[None if b is None else b.clone() for b in base] for _ in range(L)]
    B = (n + 7) // 8
    x = torch.randn(8, dim, generator=gen).abs().half()[:1]
    out = torch.empty(1, dim, dtype=torch.float16)  # the channel's out: x's dtype
    gap = args.exchange_gap_ms / 1e3
    reps = 20 if args.quick else args.exchange_reps
    variants = ("auto", "rows", "cols", "contiguous", "omp_region", "prepared_empty")
    lib, tiny = _worker_library(args), torch.ones(16 * threads)
    # the CPU executor's form of the call, prepared once per layer (cpu_ffn.prepare_bitmask), on a mask
    # with no neuron set: the exchange's fixed cost as the runtime pays it (the call itself, the
    # conversion of x, the mask's decoding, the output's store)
    no_rows = np.zeros((1, B), np.uint8)
    prepared = [cpu_ffn.prepare_bitmask(x, *ws, no_rows, n, act, None, out, qtype=qtype) for ws in layers]
    rows_out = []
    for K in map(int, args.exchange_k.split(",")):
        masks = exchange_masks(K, 1, n, 16, gen)
        times: dict[str, list[float]] = {v: [] for v in variants}
        rng = random.Random(K)
        order, layer = list(variants), 0
        for i in range(reps + 5):
            rng.shuffle(order)
            for v in order:
                layer = (layer + 1) % L
                up, gate, down_t = layers[layer]
                m = masks[(i + layer) % len(masks)]
                time.sleep(gap)
                t0 = time.perf_counter()
                if v == "omp_region":  # the kernel's threads doing nothing: wake-up + fork/join
                    lib.pi_read_sum(tiny.data_ptr(), tiny.numel(), threads)
                elif v == "prepared_empty":
                    prepared[layer](1, threads)
                elif v == "contiguous":  # no mask: rows 0 .. K-1, every one
                    cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None, K, act, None, out, threads, qtype=qtype)
                else:
                    cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, m[:1, :B], n, act, None, out, threads, split=v,
                                               qtype=qtype)
                if i >= 5:
                    times[v].append(time.perf_counter() - t0)
        nbytes = (2 if act == "relu" else 3) * K * row_width * base[0].element_size()
        for v, ts in times.items():
            fixed = v in ("omp_region", "prepared_empty")
            rows_out.append(dict(variant=v if fixed else f"bitmask_{v}", T=1, K=K, layers=L, act=act,
                                 D=dim, n=n, weights=args.exchange_dtype, shm=bool(args.exchange_shm),
                                 **_call_times(ts, None if fixed else nbytes)))
        print(f"[exchange cold {os.environ.get('OMP_WAIT_POLICY', 'unset')} "
              f"{args.exchange_build or 'default build'}] {act} {args.exchange_dtype} D={dim} n={n} t={threads} "
              f"L={L}{' shm' if args.exchange_shm else ''} K={K}: " + ", ".join(
            f"{r['variant']} {r['median_us']:.0f} us" + (f" ({r['GBps']} GB/s)" if r["GBps"] else "")
            for r in rows_out[-len(times):]), flush=True)
    return dict(threads=threads, layers=L, rows=rows_out)


def bench_cpu_exchange(args) -> dict:
    """The CPU executor's per-layer answer at the Llama-2-13B shape (D = 5120, fp16 weights, a CPU
    shard of 8600 rows, ReGLU), from the packed mask in a channel-like buffer to y in the fp32 out
    buffer. Variants: exchange_ffn_partial = unpack_mask + ffn_partial (runtime.layers);
    decode_python = its Python decoding alone (unpackbits + active_rows); kernel_call_<split> = the
    ctypes kernel call alone (inputs decoded beforehand) with the work split over rows (per-thread
    accumulators + reduction) or columns; omp_region = an empty parallel region of the kernel's
    threads (fork/join and wake-up after the gap); exchange_bitmask = the CPU executor's call
    (kernels.cpu_ffn.prepare_bitmask, checked once).
    Each variant runs in two processes, OMP_WAIT_POLICY unset and ACTIVE (libgomp reads it at load)."""
    if not cpu_library.available():
        return {"error": "compiled CPU kernel unavailable (no compiler); nothing measured"}
    if args.exchange_dtype != "fp16" and args.exchange_layers <= 1:
        raise ValueError(f"--exchange-dtype {args.exchange_dtype}: quantized shards need --exchange-layers > 1")
    res = dict(shape=dict(D=args.exchange_dim, n=args.exchange_n or EX_N, act=args.exchange_act,
                          weights=args.exchange_dtype,
                          x="fp16 (channel)", out="fp32 (channel)"),
               gap_ms=args.exchange_gap_ms,
               timing=("median wall time per call over interleaved calls (variants in a new random order "
                       "each round), each after a sleep of gap_ms; "
                       f"rotating masks whose active rows cover >= {EX_SET_BYTES >> 20} MiB (cold caches)"),
               policies={})
    builds = args.exchange_cflags.split(";") if args.exchange_cflags is not None else [None]
    policies = args.exchange_policies.split(",")
    if not policies or any(p not in EX_POLICIES for p in policies):
        raise ValueError(f"--exchange-policies {args.exchange_policies!r}: expected a comma-separated subset of "
                         f"{','.join(EX_POLICIES)}")
    rounds = max(1, args.exchange_rounds)
    combos = list(itertools.product(builds, policies))
    runs: dict[tuple, list[dict]] = {c: [] for c in combos}
    for rnd in range(rounds):
        for cflags, pol in combos if rnd % 2 == 0 else combos[::-1]:
            runs[cflags, pol].append(_exchange_run(args, cflags, pol, max(1, args.exchange_reps // rounds)))
    for (cflags, pol), docs in runs.items():
        doc = docs[0] if rounds == 1 else _median_of_rounds(docs)
        if cflags is None:
            res["policies"][pol] = doc
        else:
            res.setdefault("builds", {}).setdefault(cflags.strip() or "default", {})[pol] = doc
    if rounds > 1:
        res["rounds"] = rounds
    return res


def _median_of_rounds(docs: list[dict]) -> dict:
    """One worker result from several rounds of the same worker: each row's median / p10 / p90 the
    median over the rounds (GB/s recomputed from the row's bytes), the rounds' medians kept."""
    out = dict(docs[0], rows=[])
    for i, row in enumerate(docs[0]["rows"]):
        meds = [d["rows"][i]["median_us"] for d in docs]
        r = dict(row, round_medians_us=meds)
        for k in ("median_us", "p10_us", "p90_us"):
            r[k] = round(statistics.median(d["rows"][i][k] for d in docs), 1)
        if row.get("GBps"):  # bytes = GB/s x us x 1e3
            r["GBps"] = round(row["GBps"] * row["median_us"] / r["median_us"], 2)
        out["rows"].append(r)
    return out


def _exchange_run(args, cflags: str | None, pol: str, reps: int) -> dict:
    """One worker process of bench_cpu_exchange: OMP_WAIT_POLICY pol ('unset': none) and the kernel
    built with cflags (None: the default build); its JSON result."""
    import tempfile

    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if pol != "unset":
        env["OMP_WAIT_POLICY"] = pol
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "worker.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--exchange-worker", str(path),
               "--tokens", args.tokens, "--exchange-k", args.exchange_k, "--exchange-reps",
               str(reps), "--exchange-gap-ms", str(args.exchange_gap_ms),
               "--exchange-layers", str(args.exchange_layers), "--exchange-act", args.exchange_act,
               "--exchange-dim", str(args.exchange_dim)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--exchange-n", str(args.exchange_n)] if args.exchange_n else []
        cmd += ["--exchange-shm"] if args.exchange_shm else []
        cmd += ["--exchange-dtype", args.exchange_dtype]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--pool-spin-us", str(args.pool_spin_us)] if args.pool_spin_us is not None else []
        cmd += ["--pool-pin"] if args.pool_pin else []
        cmd += [f"--exchange-build={cflags.strip()}"] if cflags and cflags.strip() else []
        subprocess.run(cmd, env=env, check=True)
        return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def gpu_time(fn, quick: bool) -> float:
    """Median seconds per call, L2 flushed before each call (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median") / 1e3


def gpu_wall(fn, n: int = 200) -> float:
    """Seconds per call of back-to-back calls, host launch overhead included (no flush)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def graph_time(op, sets, quick: bool) -> float | None:
    """Median seconds per replay of ``op(idx)`` captured in a CUDA graph, one graph per index set
    (replayed in turn, L2 flushed before each); None (with a note) if capture fails."""
    try:
        graphs = []
        for s_ in sets:
            op(s_)  # compiled and warm before capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                op(s_)
            graphs.append(g)
    except Exception as e:  # noqa: BLE001
        print(f"[gpu] graph capture failed ({type(e).__name__}: {e}); graph timings skipped", flush=True)
        return None
    cyc = itertools.cycle(graphs)
    return gpu_time(lambda: next(cyc).replay(), quick)


def seq_time(op, layers, sets, quick: bool) -> float | None:
    """Median seconds per layer of one CUDA graph of len(layers) calls ``op(weights, idx)``, layer l
    on its own weight copy and index set l % len(sets) (L2 flushed before each replay, and the
    layers' rows outgrow it): what a layer's FFN costs inside the runtime's decode graph, where
    kernels follow each other with no host launch between them. None if capture fails."""
    pairs = list(zip(layers, itertools.cycle(sets)))
    try:
        for w, s_ in pairs:
            op(w, s_)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for w, s_ in pairs:
                op(w, s_)
    except Exception as e:  # noqa: BLE001
        print(f"[gpu] sequence capture failed ({type(e).__name__}: {e}); sequence timings skipped", flush=True)
        return None
    return gpu_time(g.replay, quick) / len(pairs)


def graph_floor(n: int, quick: bool) -> dict:
    """The timing floor of a kernel: a graph of one 1-element add replayed (launch and timing
    overhead of a single kernel), and per kernel in a graph of n of them (the gap between kernels
    inside a graph)."""
    t = torch.zeros(1, device=GPU)
    graphs = []
    for reps in (1, n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                t.add_(1)
        graphs.append(g)
    return dict(one_kernel_graph_us=round(gpu_time(graphs[0].replay, quick) * 1e6, 2),
                per_kernel_in_graph_of_n_us=round(gpu_time(graphs[1].replay, quick) / n * 1e6, 2), n=n)


# (dot?, BK, BD, warps, stages) per stage; T == 1 also tries the elementwise (non-dot) kernels.
# T == 1 whole rows per program (BD >= D = 5120, one masked step: every load of the program issued
# at once, ~1400 programs at 10 %): the up stage's ~87 programs of 16 rows left SMs idle.
SWEEP_UP = {1: [(False, 4, 1024, 4, 3), (False, 4, 2048, 8, 3), (False, 8, 512, 4, 3), (False, 8, 1024, 8, 3),
                (False, 1, 8192, 4, 1), (False, 1, 8192, 8, 1), (False, 2, 8192, 8, 1),
                (True, 16, 128, 4, 3), (True, 16, 256, 4, 3), (True, 16, 256, 4, 4), (True, 16, 512, 8, 3),
                (True, 16, 512, 8, 4), (True, 32, 256, 8, 3)],
            8: [(True, 16, 128, 4, 3), (True, 16, 256, 4, 3), (True, 16, 256, 4, 4), (True, 16, 512, 8, 3),
                (True, 16, 512, 8, 4), (True, 32, 256, 8, 3)]}
SWEEP_DOWN = {1: [(False, 64, 64, 4, 3), (False, 64, 32, 4, 3), (False, 128, 32, 8, 3), (False, 128, 16, 4, 3),
                  (False, 64, 16, 2, 3), (True, 64, 32, 4, 3),
                  (True, 128, 32, 4, 3), (True, 128, 32, 4, 4), (True, 256, 32, 4, 4), (True, 128, 16, 4, 4),
                  (True, 128, 64, 4, 3), (True, 128, 32, 8, 3), (True, 256, 32, 8, 3)],
              8: [(True, 64, 32, 4, 3), (True, 128, 32, 4, 3), (True, 128, 32, 4, 4), (True, 256, 32, 4, 4),
                  (True, 128, 16, 4, 4), (True, 128, 64, 4, 3), (True, 128, 32, 8, 3), (True, 256, 32, 8, 3)]}


# Fused variant (Config.fused_r, T == 1): (rows per block, warps, programs per SM, eager down rows),
# whole op as graph replays. The first H200 sweep (one program per block, no fence, 39ce94c): best
# r = 2, 4 warps, 28.0 us against 34.4 for the two-stage kernels (docs/log/kernels-notes.md).
SWEEP_FUSED = {1: [(1, 4, 2, True), (1, 4, 4, True), (1, 8, 2, True), (2, 4, 1, True), (2, 4, 2, True),
                   (2, 8, 1, True), (2, 8, 2, True), (1, 4, 64, True), (2, 4, 64, True), (1, 4, 2, False),
                   (2, 4, 2, False)],
               8: []}


def sweep_triton(up, gate, down_t, gen, quick: bool) -> dict:
    """Time each stage alone over tile configs at 10 % density; return the best Config per mode."""
    tf = importlib.import_module(K.__name__ + ".triton_ffn")
    k, sets = idx_sets(0.10, GPU, gen)
    best, table = {}, []
    for mode, T in (("gemv", 1), ("dot", 8)):
        x = torch.randn(T, D, generator=gen).abs().half().to(GPU)
        h = torch.rand(T, k, generator=gen).add_(0.5).to(GPU)
        hh = torch.empty(T, k, device=GPU)
        y = torch.empty(T, D, dtype=torch.float16, device=GPU)
        res_up, res_down = {}, {}
        for c in SWEEP_UP[T]:
            cfg = tf.Config(c[1], c[2], c[3], 64, 64, 4, up_stages=c[4], up_dot=c[0])
            cyc = itertools.cycle(sets)
            res_up[c] = gpu_time(lambda: tf.launch_up(x, up, gate, None, next(cyc), None, None, "reglu", hh, cfg), True)
        for c in SWEEP_DOWN[T]:
            cfg = tf.Config(16, 256, 4, c[1], c[2], c[3], down_stages=c[4], down_dot=c[0])
            cyc = itertools.cycle(sets)
            res_down[c] = gpu_time(lambda: tf.launch_down(h, down_t, next(cyc), None, y, cfg), True)
        bu, bdn = min(res_up, key=res_up.get), min(res_down, key=res_down.get)
        best[mode] = tf.Config(bu[1], bu[2], bu[3], bdn[1], bdn[2], bdn[3], up_stages=bu[4], down_stages=bdn[4],
                               up_dot=bu[0], down_dot=bdn[0])
        # whole op as graph replays, as the runtime runs it (timed as Python calls, the two
        # launches, ~40 us each on the host, outlast the L2 flush and the GPU idles between): the
        # two-stage winner against the fused variants (T == 1)
        yo = torch.empty(T, D, dtype=torch.float16, device=GPU)

        def whole(cfg):  # noqa: ANN001, ANN202
            op = lambda s_: tf.sparse_ffn_triton(x, up, gate, down_t, s_, None, "reglu", None, yo, None, cfg)  # noqa: E731
            t = graph_time(op, sets, True)
            cyc = itertools.cycle(sets)
            return t if t is not None else gpu_time(lambda: op(next(cyc)), True)

        cfgs = {"two-stage": best[mode]}
        for r, w, progs, eager in SWEEP_FUSED[T]:
            # the two-stage winner's tiles kept: T > 1 falls back to them
            cfgs[f"fused r={r} warps={w} progs/SM={progs}" + ("" if eager else " lazy")] = dataclasses.replace(
                best[mode], fused_r=r, fused_warps=w, fused_progs=progs, eager_down=eager)
        res_op = {}
        for name, c in cfgs.items():
            try:
                res_op[name] = whole(c)
            except Exception as e:  # noqa: BLE001 -- a variant that fails to compile or run is skipped
                print(f"[sweep] T={T} {name}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
        for name, t in sorted(res_op.items(), key=lambda kv: kv[1]):
            table.append(dict(T=T, stage="whole op", variant=name, us=round(t * 1e6, 2), GBps=round(3 * k * D * 2 / t / 1e9, 1)))
        win = min(res_op, key=res_op.get)
        best[mode] = cfgs[win]
        print(f"[sweep] T={T} whole op as graph replays: two-stage {res_op['two-stage']*1e6:.1f} us, best {win} "
              f"{res_op[win]*1e6:.1f} us ({3*k*D*2/res_op[win]/1e9:.0f} GB/s)", flush=True)
        for stage, res, nb in (("up", res_up, 2 * k * D * 2), ("down", res_down, k * D * 2)):
            for c, t in sorted(res.items(), key=lambda kv: kv[1]):
                table.append(dict(T=T, stage=stage, dot=c[0], bk=c[1], bd=c[2], warps=c[3], stages=c[4], us=round(t * 1e6, 2),
                                  GBps=round(nb / t / 1e9, 1)))
        print(f"[sweep] T={T}: best up {bu} {res_up[bu]*1e6:.1f} us ({2*k*D*2/res_up[bu]/1e9:.0f} GB/s), "
              f"best down {bdn} {res_down[bdn]*1e6:.1f} us ({k*D*2/res_down[bdn]/1e9:.0f} GB/s)", flush=True)
    return dict(best={m: vars(c) for m, c in best.items()}, table=table, _configs=best)


def bench_split(gen, quick: bool) -> list[dict]:
    """The predictor split at N = 13824 (30 % of neurons on the GPU): exact (syncs) vs packed."""
    ts = importlib.import_module(K.__name__ + ".triton_split")
    out = []
    gpu = torch.rand(N, generator=gen).lt(0.3).to(GPU)
    ng = int(gpu.sum())
    loc = K.local_index(gpu)
    for T in (1, 8):
        logits = (torch.randn(T, N, generator=gen) - 1.0).half().to(GPU)
        cases = {
            "exact_torch (nonzero, syncs)": lambda: K.split_active(logits, 0.0, gpu, loc),
            "packed_torch": lambda: K.split_active_packed(logits, 0.0, gpu, local_of=loc, gpu_capacity=ng,
                                                          cpu_capacity=N - ng, backend="torch"),
            "packed_triton": lambda: K.split_active_packed(logits, 0.0, gpu, local_of=loc, gpu_capacity=ng,
                                                           cpu_capacity=N - ng, backend="triton"),
            "packed_triton_bn4096": lambda: ts.split_pack(logits, 0.0, gpu, loc, ng, N - ng, bn=4096),
        }
        for name, fn in cases.items():
            t, w = gpu_time(fn, quick), gpu_wall(fn, 100)
            out.append(dict(T=T, variant=name, gpu_median_us=round(t * 1e6, 2), wall_us_per_call=round(w * 1e6, 2)))
            print(f"[split] T={T} {name}: {t*1e6:.1f} us GPU, {w*1e6:.1f} us wall", flush=True)
    return out


def check_gpu(x, up, gate, down_t, idx, cfg, tf, qtype=None) -> float:
    """Relative L2 error of the timed configuration against the float64 reference (NaN-poisoned out)."""
    out = torch.full_like(x, float("nan"))
    y = tf.sparse_ffn_triton(x, up, gate, down_t, idx, None, "reglu", None, out, None, cfg, qtype=qtype).double()
    ref = K.sparse_ffn_ref(x, up, gate, down_t, idx, qtype=qtype)
    return float("inf") if not torch.isfinite(y).all() else float((y - ref).norm() / ref.norm())


def gpu_layers(w, seq_layers: int) -> list:
    """w and seq_layers - 1 copies (each layer of the sequence graph on its own weights), as many as
    fit in half the free GPU memory."""
    layer_bytes = sum(t.numel() * t.element_size() for t in w)
    fits = 1 + int(0.5 * torch.cuda.mem_get_info()[0] // layer_bytes)
    if seq_layers > fits:
        print(f"[gpu] --seq-layers {seq_layers}: {fits} layers fit in half the free GPU memory; using {fits}",
              flush=True)
    return [w] + [tuple(t.clone() for t in w) for _ in range(min(seq_layers, fits) - 1)]


def gpu_case(tf, dname, w, layers, cfg, T, pct, ceiling, gen, args) -> dict:
    """One (weights, T, density) case: kernel and torch baseline times, the stages alone, graph
    replays, per layer in a graph of len(layers) layers, error against float64."""
    qtype = dname if dname in QTYPES else None
    up, gate, down_t = w
    k, sets = idx_sets(pct / 100, GPU, gen, args.order)
    x = torch.randn(T, D, generator=gen).abs().half().to(GPU)
    out = torch.empty(T, D, dtype=torch.float16, device=GPU)
    cyc = itertools.cycle(sets)
    op = lambda w_, s_: tf.sparse_ffn_triton(x, *w_, s_, None, "reglu", None, out, None, cfg, qtype=qtype)  # noqa: E731
    t_k = gpu_time(lambda: op(w, next(cyc)), args.quick)
    wall = gpu_wall(lambda: op(w, next(cyc)))
    t_b = gpu_time(lambda: torch_baseline(x, up, gate, down_t, next(cyc), qtype), args.quick)
    t_up = t_dn = float("nan")  # the stages alone: two-stage configs only
    if not cfg.fused:
        h = torch.empty(T, k, device=GPU)
        t_up = gpu_time(lambda: tf.launch_up(x, up, gate, None, next(cyc), None, None, "reglu", h, cfg, qtype),
                        args.quick)
        h.uniform_(0.5, 1.5)  # nonzero activations: every down row is read
        t_dn = gpu_time(lambda: tf.launch_down(h, down_t, next(cyc), None, out, cfg, qtype), args.quick)
    err = check_gpu(x, up, gate, down_t, sets[0], cfg, tf, qtype)
    t_g = graph_time(lambda s_: op(w, s_), sets, args.quick)
    row = record("cuda", "triton", dname, T, pct, k, t_k, t_b, ceiling,
                 dict(wall_us_per_call=round(wall * 1e6, 2),
                      up_stage_us=None if cfg.fused else round(t_up * 1e6, 2),
                      down_stage_us=None if cfg.fused else round(t_dn * 1e6, 2),
                      rel_err_vs_fp64=float(f"{err:.3g}"), config=vars(cfg)))
    if t_g is not None:  # as the runtime runs it: one graph replay, no Python launch per kernel
        row.update(graph_median_us=round(t_g * 1e6, 2), graph_GBps=round(row["GBps"] * t_k / t_g, 1),
                   graph_frac_ceiling=round(row["frac_ceiling"] * t_k / t_g, 3))
    t_s = seq_time(op, layers, sets, args.quick) if len(layers) > 1 else None
    if t_s is not None:  # per layer inside a graph of len(layers) layers
        row.update(seq_layer_us=round(t_s * 1e6, 2), seq_GBps=round(row["GBps"] * t_k / t_s, 1),
                   seq_frac_ceiling=round(row["frac_ceiling"] * t_k / t_s, 3))
    print(f"[gpu] {dname} T={T} {pct:g}%{' fused' if cfg.fused else ''}: {row['median_us']:.1f} us {row['GBps']:.0f} GB/s "
          f"({row['frac_ceiling']:.0%} of copy; up {t_up*1e6:.1f} + down {t_dn*1e6:.1f} us alone); "
          f"torch {row['baseline_median_us']:.1f} us -> x{row['speedup_vs_baseline']:.1f}; "
          f"wall {wall*1e6:.1f} us/call; graph replay {row.get('graph_median_us', float('nan')):.1f} us "
          f"({row.get('graph_frac_ceiling', float('nan')):.0%} of copy); per layer in a graph of "
          f"{len(layers)} {row.get('seq_layer_us', float('nan')):.1f} us "
          f"({row.get('seq_frac_ceiling', float('nan')):.0%}); err {err:.1e}", flush=True)
    return row


LINEAR_SHAPES = {"attn_5120x5120": (5120, 5120), "head_32000x5120": (32000, 5120), "fc1_1024x5120": (1024, 5120),
                 "fc2_13824x1024": (13824, 1024)}
LINEAR_TOKENS = (1, 4, 8, 16, 32, 64)


def bench_gpu_linear(qtypes, ceiling, gen, quick: bool) -> list[dict]:
    """The dense GEMV on quantized rows (kernels.linear: attention projections, output head,
    predictor) at LINEAR_TOKENS tokens, on the file's blocks and on repacked Q4_0 rows (what a CUDA
    primary holds); on blocks from 2 to 32 tokens also the tl.dot up stage ("blocks-dot", what
    triton_linear runs beyond TOKENS_MAX) and the rows dequantized a chunk at a time through cuBLAS
    ("blocks-dequant", what more than GEMV_MAX_T tokens run); at T = 1 the repacked kernel's tiles
    around the default. GB/s on the compressed bytes, L2 flushed before each call."""
    from powerinfer_ray.kernels.linear import GEMV_MAX_T, dequantized_linear, linear
    from powerinfer_ray.kernels.triton_linear import linear_up_stage
    from powerinfer_ray.kernels.triton_qgemv import qgemv_triton

    rows = []
    tiles = [(br, nb, wp) for br in (4, 8, 16) for nb in (16, 32, 64) for wp in (4, 8)]
    for qtype, (name, (R, Dw)) in itertools.product(qtypes, LINEAR_SHAPES.items()):
        nb = R * quant.row_bytes(qtype, Dw)
        w = torch.randint(0, 256, (R, nb // R), generator=gen, dtype=torch.uint8)
        w.view(R, -1, quant.BLOCK_BYTES[qtype])[..., :2] = torch.full((1,), 1e-3, dtype=torch.float16).view(torch.uint8)
        w = w.to(GPU)
        forms = {"blocks": (w, qtype), "blocks-dot": (w, qtype), "blocks-dequant": (w, qtype)}
        if qtype in quant.REPACKED:
            forms["repacked"] = (quant.repack(w, qtype), quant.REPACKED[qtype])
        for T, (form, (wf, q)) in itertools.product(LINEAR_TOKENS, forms.items()):
            if form in ("blocks-dot", "blocks-dequant") and not 1 < T <= GEMV_MAX_T:
                continue
            x = torch.randn(T, Dw, generator=gen).half().to(GPU)
            if form == "blocks-dot":
                y = torch.empty(T, R, device=GPU)
                op = lambda: linear_up_stage(x, wf, q, None, False, y)  # noqa: E731
            elif form == "blocks-dequant":
                op = lambda: dequantized_linear(x, wf, q)  # noqa: E731
            else:
                op = lambda: linear(x, wf, qtype=q)  # noqa: E731
            t = gpu_time(op, quick)
            g = graph_time(lambda _s: op(), [None], quick)
            row = dict(qtype=qtype, shape=name, T=T, form=form, bytes=nb, median_us=round(t * 1e6, 2),
                       GBps=round(nb / t / 1e9, 1), frac_ceiling=round(nb / t / 1e9 / ceiling, 4))
            if g is not None:
                row.update(graph_median_us=round(g * 1e6, 2), graph_GBps=round(nb / g / 1e9, 1))
            if T == 1 and form == "repacked":
                times = {c: gpu_time(lambda c=c: qgemv_triton(x, wf, q, br=c[0], nb=c[1], warps=c[2]), True)
                         for c in tiles}
                best = min(times, key=times.get)
                row.update(tiles_us={"x".join(map(str, c)): round(v * 1e6, 2) for c, v in times.items()},
                           best_tiles="x".join(map(str, best)), best_tiles_us=round(times[best] * 1e6, 2))
            rows.append(row)
            print(f"[gpu linear] {qtype} {name} T={T} {form}: {row['median_us']} us {row['GBps']} GB/s "
                  f"(graph {row.get('graph_median_us')} us; best tiles {row.get('best_tiles')} "
                  f"{row.get('best_tiles_us')} us)", flush=True)
        del w, forms
    return rows


def bench_gpu(args) -> dict:
    tf = importlib.import_module(K.__name__ + ".triton_ffn")

    gen = torch.Generator().manual_seed(1)
    big = torch.empty(COPY_BYTES, dtype=torch.uint8, device=GPU)
    dst = torch.empty_like(big)
    ceiling = 2 * big.numel() / gpu_time(lambda: dst.copy_(big), args.quick) / 1e9
    del big, dst
    print(f"[gpu] {torch.cuda.get_device_name()}: D2D copy {ceiling:.0f} GB/s (read + write)", flush=True)
    floor = graph_floor(max(1, args.seq_layers), args.quick)
    print(f"[gpu] floor: one-kernel graph {floor['one_kernel_graph_us']} us, "
          f"{floor['per_kernel_in_graph_of_n_us']} us per kernel in a graph of {floor['n']}", flush=True)
    rows, sweep, configs = [], None, dict(tf.CONFIGS)
    for dname in args.gpu_dtypes.split(","):
        w = weights(dname, GPU, gen)
        if args.sweep and dname == "fp16":  # the tiles are tuned on fp16 and kept for the other formats
            sweep = sweep_triton(*w, gen, args.quick)
            configs = sweep.pop("_configs")
        layers = gpu_layers(w, args.seq_layers)
        for T, pct in itertools.product(map(int, args.tokens.split(",")), map(float, args.densities.split(","))):
            cfg = configs["gemv" if T == 1 else "dot"]
            if dname in QTYPES:  # quantized rows run the two stages
                cfg = dataclasses.replace(cfg, fused_r=0)
            rows.append(gpu_case(tf, dname, w, layers, cfg, T, pct, ceiling, gen, args))
        del w, layers
    qtypes = [d for d in args.gpu_dtypes.split(",") if d in QTYPES]
    linear_rows = bench_gpu_linear(qtypes, ceiling, gen, args.quick) if qtypes else []
    split = bench_split(gen, args.quick)
    res = dict(device_name=torch.cuda.get_device_name(), ceiling_copy_GBps=round(ceiling, 1),
               ceiling_method="torch copy_ of 1 GiB device to device, bytes read + written, L2 flushed",
               timing="triton.testing.do_bench median, L2 flushed before each call; wall_us_per_call = "
                      "back-to-back calls incl. host launch overhead; graph_median_us = one CUDA-graph replay "
                      "of the op (as the runtime's decode step runs it); seq_layer_us = per layer in one CUDA graph "
                      "of seq_layers calls, each on its own weight copy",
               active_bytes="3 x K x row bytes (q4_0 / q8_0: the compressed bytes)",
               seq_layers=args.seq_layers, floor=floor, results=rows, linear=linear_rows, split=split)
    if sweep:
        res["sweep"] = sweep
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.exchange_worker:
        work = _exchange_cold if args.exchange_layers > 1 else _exchange_worker
        Path(args.exchange_worker).write_text(json.dumps(work(args)))
        return 0
    use_gpu = args.device in ("auto", "cuda") and torch.cuda.is_available()
    if args.device == "cuda" and not use_gpu:
        print("bench kernels: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    report = dict(
        machine=args.machine or machine_name(), commit=args.commit or commit(), env=settings(),
        command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__, python=platform.python_version(),
        cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
        load_average_at_start=os.getloadavg(),
        shape=dict(D=D, N=N, act="reglu"), active_bytes="3 x K x row bytes (q4_0 / q8_0: compressed)",
        row_order=args.order,
        data="x and gate rows positive: every active neuron has a nonzero activation, every active byte is read",
    )
    if args.cpu_exchange:
        if args.tokens == "1,8":
            args.tokens = "1,4"
        report["cpu_exchange"] = bench_cpu_exchange(args)
    else:
        if use_gpu:
            report["gpu"] = bench_gpu(args)
        if args.device in ("auto", "cpu"):
            report["cpu"] = bench_cpu(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels-{'exchange-' if args.cpu_exchange else ''}{report['machine']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
