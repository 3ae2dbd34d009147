"""Cold FFN rows read by the GPU straight from host memory over PCIe (zero-copy), beside the CPU
kernel reading others: does the GPU add bandwidth the CPU's cold path cannot use?

    python bench/zerocopy_bench.py /dev/shm/llama2-13b-f16.gguf --out-dir bench/results --name zerocopy-13b-h200

While the CPU executor reads a layer's active cold rows the GPU mostly waits. The file's pages on
tmpfs can be page-locked in place (read-only cudaHostRegister, as dense prefill already does) and
then read by a GPU kernel: the project's Triton sparse FFN over CUDA views of the mapping.
Measured here, one layer of the file:

- ``register``: seconds to page-lock a layer's ffn_up / ffn_gate / ffn_down_t (a load-time cost);
- ``gpu``: ``kernels.sparse_ffn.sparse_ffn`` (Triton) over K random rows, T tokens, every token
  using every row, from the GPU's own copy (``hbm``) and from the host pages (``zerocopy``): µs
  per call (CUDA events, median) and GB/s of the rows' bytes (3 rows of D fp16 each);
- ``concurrent``: the CPU kernel (``sparse_ffn_bitmask``, --threads, rows of another layer, 10 %
  of them active per call) alone, then while the GPU runs the zero-copy kernel in a loop, and the
  GPU's zero-copy rate while the CPU kernel runs: GB/s of each.

The zero-copy results are checked against the same call on the GPU's copy.

``--qtype q4_0|q8_0`` (no model file): the T == 1 kernels on random ggml block rows at the 13B's
shape (8600 rows of 5120 per matrix, --layers copies: more than the GPU's L2), from the GPU's
memory (``hbm``) and from page-locked host memory (``zerocopy``): the two stages (``two-stage``,
the configuration of quantized rows in the GPU's memory) against the fused kernel at each
rows-per-block / warps / programs / eager-down configuration of --fused. µs per call from a CUDA graph of one call per layer,
GB/s of the rows' compressed bytes; each output checked against the two stages' from the GPU's copy.
"""
from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def time_gpu(fn, reps: int) -> float:  # noqa: ANN001
    """Median µs of fn() by CUDA events, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


class CpuLoad(threading.Thread):
    """The CPU kernel in a loop (ctypes releases the GIL), bytes and seconds counted."""

    def __init__(self, mats: list[torch.Tensor], threads: int, density: float) -> None:
        super().__init__(daemon=True)
        from powerinfer_ray.runtime.channel import pack_mask

        self.mats, self.threads = mats, threads
        n, D = mats[0].shape
        rng = np.random.default_rng(1)
        self.masks = [pack_mask(torch.from_numpy(rng.random((1, n)) < density)).numpy() for _ in range(8)]
        self.x = torch.randn(1, D).half()
        self.out = torch.empty(1, D, dtype=torch.float16)
        self.n = n
        self.stop = threading.Event()
        self.nbytes = 0
        self.seconds = 0.0

    def call(self, i: int) -> int:
        from powerinfer_ray.kernels.cpu_ffn import sparse_ffn_bitmask

        up, gate, down = self.mats
        _, rows, down_rows = sparse_ffn_bitmask(self.x, up, gate, down, self.masks[i % 8], self.n, "reglu", None,
                                                self.out, self.threads)[:3]
        return (2 * rows + down_rows) * up.shape[1] * up.element_size()

    def run(self) -> None:
        i, t0 = 0, time.perf_counter()
        while not self.stop.is_set():
            self.nbytes += self.call(i)
            i += 1
        self.seconds = time.perf_counter() - t0


def time_graph(calls, reps: int) -> float:  # noqa: ANN001
    """Median µs a call of the calls [fn] captured in one CUDA graph (after a warm-up run)."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    return time_gpu(g.replay, reps) / len(calls)


def quant_sweep(a) -> list[dict]:  # noqa: ANN001
    """--qtype: the T == 1 kernels over quantized rows in the GPU's memory and in host memory."""
    import dataclasses

    from kernels_bench import make_qweights

    from powerinfer_ray.kernels import quant
    from powerinfer_ray.kernels.triton_ffn import CONFIGS, sparse_ffn_triton
    from powerinfer_ray.runtime.channel import device_view

    n, D = 8600, 5120
    gen = torch.Generator().manual_seed(0)
    host = [[t.pin_memory() for t in make_qweights(a.qtype, "cpu", gen, n, D)] for _ in range(a.layers)]
    where = {"hbm": [[t.to("cuda") for t in ws] for ws in host], "zerocopy": [[device_view(t) for t in ws] for ws in host]}
    gemv = CONFIGS["qhost"]
    cfgs = {"two-stage": CONFIGS["qgemv"]}
    for bd in (int(b) for b in a.down_bd.split(",") if b):
        cfgs[f"two-stage-bd{bd}"] = dataclasses.replace(CONFIGS["qgemv"], down_bd=bd)
    for spec in a.fused.split(","):  # rows x warps, p programs per SM, e for eager down rows
        m = re.fullmatch(r"(\d+)x(\d+)(?:p(\d+))?", spec.replace("e", "", 1))
        if m is None:
            raise SystemExit(f"--fused {spec!r}: expected ROWSxWARPS[pPROGRAMS][e], e.g. 2x8, 1x4p1e")
        r, w, progs = m.groups()
        cfgs[f"fused-{spec}"] = dataclasses.replace(gemv, fused_r=int(r), fused_warps=int(w),
                                                    fused_progs=int(progs or gemv.fused_progs), eager_down="e" in spec)
    x = (torch.rand(1, D, generator=gen) * 0.1).half().cuda()  # x and gate > 0: every row active
    rng = np.random.default_rng(0)
    row_bytes = quant.row_bytes(a.qtype, D)
    records = []
    for k in (int(s) for s in a.ks.split(",")):
        idxs = [torch.from_numpy(np.sort(rng.choice(n, k, replace=False)).astype(np.int32)).cuda()
                for _ in range(a.layers)]
        outs = [torch.empty(1, D, dtype=torch.float16, device="cuda") for _ in range(a.layers)]

        def call(i: int, layers, cfg) -> torch.Tensor:  # noqa: ANN001
            up, gate, down = layers[i]
            return sparse_ffn_triton(x, up, gate, down, idxs[i], None, "reglu", None, outs[i], None, cfg,
                                     qtype=a.qtype)

        want = [call(i, where["hbm"], cfgs["two-stage"]).float() for i in range(a.layers)]
        for loc, layers in where.items():
            for name, cfg in cfgs.items():
                try:
                    us = time_graph([lambda i=i, w=layers, c=cfg: call(i, w, c) for i in range(a.layers)], a.reps)
                except Exception as e:  # noqa: BLE001 -- a configuration that does not compile: say so, go on
                    print(f"{a.qtype} K={k} {loc} {name}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                    continue
                err = max(float((outs[i].float() - want[i]).abs().max() / want[i].abs().max()) for i in range(a.layers))
                rec = {"kind": "quant", "qtype": a.qtype, "where": loc, "kernel": name, "rows": k, "us": us,
                       "gbps": 3 * k * row_bytes / us / 1e3, "rel_err_vs_two_stage_hbm": err}
                records.append(rec)
                print(f"{a.qtype} K={k} {loc:8s} {name:12s}: {us:7.1f} us {rec['gbps']:6.1f} GB/s (rel err {err:.1e})",
                      flush=True)
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="an fp16 GGUF file on /dev/shm (ffn_up / ffn_gate / ffn_down_t [n_ff, D])")
    p.add_argument("--qtype", choices=("q4_0", "q8_0"), help="random block rows instead of a model file (see above)")
    p.add_argument("--layers", type=int, default=8, help="--qtype: copies of the rows, one per call of a graph")
    p.add_argument("--fused", default="1x4,2x4,1x8,2x8,2x8p1,4x8,2x16,4x16,1x4e,2x8e",
                   help="--qtype: fused configurations, rows x warps [p programs per SM] (e: eager down rows)")
    p.add_argument("--down-bd", default="128,256", help="--qtype: the two stages also with these down tiles")
    p.add_argument("--layer", type=int, default=0, help="the layer whose rows the GPU reads (the CPU: the next)")
    p.add_argument("--ks", default="64,256,1024,4096", help="rows per call")
    p.add_argument("--tokens", default="1,32", help="T of the GPU calls")
    p.add_argument("--threads", type=int, default=14, help="the CPU kernel's threads")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--seconds", type=float, default=3.0, help="each concurrent measurement")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="zerocopy")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("zerocopy_bench measures a CUDA device: no GPU here", file=sys.stderr)
        return 2
    from model_bench import write_results

    command = "python bench/zerocopy_bench.py " + shlex.join(sys.argv[1:])
    if a.qtype:
        write_results(a.out_dir, a.name, command, qtype=a.qtype, records=quant_sweep(a))
        return 0
    if a.model is None:
        p.error("give a model file, or --qtype")

    from powerinfer_ray.kernels.sparse_ffn import sparse_ffn
    from powerinfer_ray.model import gguf_keys as K
    from powerinfer_ray.model.source import mapped_tensor, open_model
    from powerinfer_ray.runtime.channel import device_view
    from powerinfer_ray.runtime.cold import pin_mapped

    src = open_model(a.model)
    cfg = src.config
    names = (K.FFN_UP, K.FFN_GATE, K.FFN_DOWN_T)
    host = [mapped_tensor(src, K.tensor(t, a.layer)) for t in names]
    other = [mapped_tensor(src, K.tensor(t, (a.layer + 1) % cfg.n_layer)) for t in names]
    if any(v is None or v.dtype != torch.float16 for v in host + other):
        print("zerocopy_bench: the file must hold ffn_up / ffn_gate / ffn_down_t as f16 [n_ff, D]", file=sys.stderr)
        return 2
    torch.empty(1, device="cuda")
    records: list[dict] = []
    t0 = time.perf_counter()
    ok = pin_mapped(host, "a layer's rows", [])
    reg_s = time.perf_counter() - t0
    nbytes = sum(v.numel() * v.element_size() for v in host)
    records.append({"kind": "register", "bytes": nbytes, "seconds": reg_s, "gbps": nbytes / reg_s / 1e9, "ok": ok})
    print(f"registered {nbytes / 2**20:.0f} MiB in {reg_s * 1e3:.1f} ms (ok {ok})", flush=True)
    if not ok:
        return 1
    zc = [device_view(v) for v in host]
    hbm = [v.to("cuda") for v in host]
    n, D = host[0].shape
    row_bytes = D * 2
    rng = np.random.default_rng(0)
    for T in (int(t) for t in a.tokens.split(",")):
        x = (torch.randn(T, D, device="cuda") * 0.1).half()
        for k in (int(s) for s in a.ks.split(",")):
            idx = torch.from_numpy(np.sort(rng.choice(n, k, replace=False))).to("cuda")
            want = sparse_ffn(x, *hbm, idx, None, "reglu")
            got = sparse_ffn(x, *zc, idx, None, "reglu")
            err = float((got.float() - want.float()).abs().max())
            for where, w in (("hbm", hbm), ("zerocopy", zc)):
                us = time_gpu(lambda w=w: sparse_ffn(x, *w, idx, None, "reglu"), a.reps)
                rec = {"kind": "gpu", "where": where, "tokens": T, "rows": k, "us": us,
                       "gbps": 3 * k * row_bytes / us / 1e3, "max_abs_diff_vs_hbm": err}
                records.append(rec)
                print(f"T={T} K={k} {where:8s}: {us:8.1f} us, {rec['gbps']:6.1f} GB/s (max diff {err:.2e})", flush=True)
    # the CPU kernel alone, then beside the GPU's zero-copy loop
    k = int(a.ks.split(",")[-1])
    idx = torch.from_numpy(np.sort(rng.choice(n, k, replace=False))).to("cuda")
    x = (torch.randn(1, D, device="cuda") * 0.1).half()

    def cpu_rate(gpu_busy: bool) -> tuple[float, float]:
        load = CpuLoad(other, a.threads, 0.1)
        load.call(0)  # the kernels built and the pages touched, outside the timing
        calls, g_bytes, t_start = 0, 0, time.perf_counter()
        load.start()
        while time.perf_counter() - t_start < a.seconds:
            if gpu_busy:
                sparse_ffn(x, *zc, idx, None, "reglu")
                calls += 1
                if calls % 20 == 0:
                    torch.cuda.synchronize()
            else:
                time.sleep(0.01)
        torch.cuda.synchronize()
        g_s = time.perf_counter() - t_start
        load.stop.set()
        load.join()
        g_bytes = calls * 3 * k * row_bytes
        return load.nbytes / load.seconds / 1e9, g_bytes / g_s / 1e9

    cpu_alone, _ = cpu_rate(False)
    cpu_with, gpu_with = cpu_rate(True)
    gpu_alone = 3 * k * row_bytes / time_gpu(lambda: sparse_ffn(x, *zc, idx, None, "reglu"), a.reps) / 1e3
    records.append({"kind": "concurrent", "threads": a.threads, "rows": k, "cpu_alone_gbps": cpu_alone,
                    "cpu_with_gpu_gbps": cpu_with, "gpu_zerocopy_alone_gbps": gpu_alone,
                    "gpu_zerocopy_with_cpu_gbps": gpu_with, "sum_gbps": cpu_with + gpu_with})
    print(f"CPU kernel ({a.threads} threads) alone {cpu_alone:.1f} GB/s; with the GPU's zero-copy loop: CPU "
          f"{cpu_with:.1f} + GPU {gpu_with:.1f} = {cpu_with + gpu_with:.1f} GB/s (GPU alone {gpu_alone:.1f})", flush=True)
    write_results(a.out_dir, a.name, command, model=a.model,
                  layer=a.layer, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
