"""Microbenchmark of the per-layer synchronisation between the GPU executor and the CPU executor.

Two Ray actors on one node, set up through Ray exactly as the engine does: the "primary" creates
the shared-memory channel (pinned with cudaHostRegister when CUDA is present), the "peer"
attaches and serves. Per round trip: the primary copies a hidden state (D values in the
compute dtype: fp16 from a GPU) and an active-neuron mask (packed 8 a byte) into the channel
(D2H from the GPU when present), publishes, spins for the answer, and copies the peer's output
back (H2D). On CUDA the copies (and the mask packing) run as captured CUDA graphs, as in the
decode step (round_trip_us_median, split into send / notify / peer / return / recv medians, all
on the shared monotonic clock; per_layer_sync_us = median of the round trip less the peer's work);
the eager form is reported beside it. The peer spins on the request flag, copies input to
output, answers. Beside it, the same payload as a plain Ray actor call, and the coordinator's
per-step call with B = 1 logits (128 KB) back: a Ray call (step_ray_call_us_median) vs the step
link over a Unix socket (step_link_us_median).

    powerinfer-ray bench sync [--d 5120] [--iters 2000]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import ray

ROOT = Path(__file__).resolve().parent.parent


@ray.remote
class Peer:
    def attach(self, spec) -> None:  # noqa: ANN001
        import threading

        from powerinfer_ray.runtime.channel import OP_STOP, Channel

        self.ch = Channel.attach(spec)

        def serve() -> None:
            last = 0
            while True:
                last = self.ch.wait_request(last)
                t = time.monotonic_ns()
                op, _, _, n_tok, _ = self.ch.request()
                self.ch.out[:n_tok].copy_(self.ch.x_ffn[:n_tok])
                self.ch.respond(last, t)
                if op == OP_STOP:
                    return

        threading.Thread(target=serve, daemon=True).start()

    def echo(self, x):  # noqa: ANN001, ANN201
        return x

    def logits(self, slots, tokens, start_pos):  # noqa: ANN001, ANN201
        """A decode step's answer as the engine's coordinator gets it: float32 [B, 32000]."""
        return np.full((len(slots), 32000), float(start_pos[0]), np.float32)

    def open_link(self) -> str:
        from powerinfer_ray.runtime.steplink import StepServer

        self.link = StepServer(self.logits, name="bench")
        return str(self.link.path)


@ray.remote
class Primary:
    def run(self, peer, d: int, n_mask: int, iters: int) -> dict:  # noqa: ANN001
        import torch

        from powerinfer_ray.kernels.predictor import pack_active_bits
        from powerinfer_ray.runtime.channel import OP_FFN, OP_STOP, Channel

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        x_dtype = "f16" if dev.type == "cuda" else "f32"  # what the engine sends from each device
        ch = Channel.create(d=d, t_max=1, b_max=1, n_mask=n_mask, x_dtype=x_dtype)
        ch.pin_for_cuda()
        ray.get(peer.attach.remote(ch.spec))
        x = torch.randn(1, d, device=dev).to(ch.x_ffn.dtype)
        logits = torch.randn(1, n_mask, device=dev).to(ch.x_ffn.dtype) - 1.3  # ~10 % active
        y = torch.zeros(1, d, device=dev, dtype=ch.out.dtype)  # a plain H2D copy, as the decode step does

        def send() -> None:  # what the decode step's graph does before a post
            ch.x_ffn[:1].copy_(x, non_blocking=True)
            packed = pack_active_bits(logits, 0.0)  # [1, n/8]: threshold + packing, as the engine does
            torch.from_numpy(ch.mask_rows(1, n_mask)).copy_(packed, non_blocking=True)

        def recv() -> None:  # and what the next graph does first
            y.copy_(ch.out[:1], non_blocking=True)

        def timed(send, recv, n):  # noqa: ANN001, ANN202
            """Per round trip (monotonic clock, shared with the peer): send = copies into the
            channel until the host sees them done, notify = post -> peer sees it, peer = its
            work, return = peer done -> host sees it, recv = copy back until done."""
            parts = {k: [] for k in ("round_trip", "send", "notify", "peer", "return", "recv", "sync")}
            for i in range(n + 100):
                t0 = time.monotonic_ns()
                send()
                if dev.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                tp = time.monotonic_ns()
                seq = ch.post(OP_FFN, 0, 1, 1, n_mask)
                ts, te = ch.wait_response(seq, timeout_s=10)
                tseen = time.monotonic_ns()
                recv()
                if dev.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                t1 = time.monotonic_ns()
                if i >= 100:
                    for k, v in (("round_trip", t1 - t0), ("send", tp - t0), ("notify", ts - tp), ("peer", te - ts),
                                 ("return", tseen - te), ("recv", t1 - tseen),
                                 ("sync", (t1 - t0) - (te - ts))):  # the round trip less the peer's work
                        parts[k].append(v / 1e3)
            return parts

        eager = timed(send, recv, iters // 2)
        parts = eager
        graphs = None
        if dev.type == "cuda":  # the runtime's form: both sides of the exchange in CUDA graphs
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                send(), recv()
            torch.cuda.current_stream().wait_stream(side)
            g_send, g_recv = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_send):
                send()
            with torch.cuda.graph(g_recv):
                recv()
            parts = graphs = timed(g_send.replay, g_recv.replay, iters)
        assert torch.equal(y, x), "echo mismatch"
        ch.wait_response(ch.post(OP_STOP, 0, 0, 0, 0), timeout_s=5)
        ray_rt = []
        payload = np.random.rand(d // 2).astype(np.float32)  # 10 KB at d=5120
        for i in range(200):
            t0 = time.perf_counter_ns()
            ray.get(peer.echo.remote(payload))
            if i >= 20:
                ray_rt.append((time.perf_counter_ns() - t0) / 1e3)
        # the coordinator's per-step call to the primary (B = 1, logits back): Ray vs the step link
        step_ray, step_link = [], []
        for i in range(200):
            t0 = time.perf_counter_ns()
            ray.get(peer.logits.remote([0], [[1]], [i]))
            if i >= 20:
                step_ray.append((time.perf_counter_ns() - t0) / 1e3)

        async def link_calls() -> None:
            from powerinfer_ray.runtime.steplink import StepClient

            cli = StepClient(ray.get(peer.open_link.remote()))
            for i in range(500):
                t0 = time.perf_counter_ns()
                out = await cli.call([0], [[1]], [i])
                if i >= 50:
                    step_link.append((time.perf_counter_ns() - t0) / 1e3)
            assert out.shape == (1, 32000) and out[0, 0] == 499
            cli.close()

        import asyncio

        asyncio.run(link_calls())
        pinned = ch.pinned
        ch.close(unlink=True)
        med = lambda v: float(np.median(v))  # noqa: E731
        res = {"device": str(dev), "pinned": pinned, "iters": iters, "cuda_graphs": graphs is not None,
               "round_trip_us_p90": float(np.percentile(parts["round_trip"], 90))}
        res.update({f"{k}_us_median": med(v) for k, v in parts.items()})
        res.update(round_trip_eager_us_median=med(eager["round_trip"]), ray_call_us_median=med(ray_rt),
                   step_ray_call_us_median=med(step_ray), step_link_us_median=med(step_link))
        return res


@ray.remote
class ExchangePrimary:
    def run(self, cpu, n_layer: int, d: int, n_mask: int, k: int, iters: int, gap_us: float) -> dict:  # noqa: ANN001
        import torch

        from powerinfer_ray.runtime.channel import OP_FFN, OP_STOP, Channel, pack_mask

        ch = Channel.create(d=d, t_max=1, b_max=1, n_mask=n_mask, x_dtype="f16")
        ray.get(cpu.attach.remote(ch.spec))
        gen = np.random.default_rng(0)
        ch.x_ffn[:1] = torch.from_numpy(gen.standard_normal((1, d)).astype(np.float16))
        masks = []
        for _ in range(16):
            m = np.zeros((1, n_mask), bool)
            m[0, gen.choice(n_mask, k, replace=False)] = True
            masks.append(pack_mask(torch.from_numpy(m)).numpy())
        rt, answer = [], []
        for i in range(iters + 100):
            ch.mask_rows(1, n_mask)[:] = masks[i % len(masks)]
            t0 = time.perf_counter_ns()
            ts, te = ch.wait_response(ch.post(OP_FFN, i % n_layer, 1, 1, n_mask), timeout_s=30, spin_s=1.0)
            t1 = time.perf_counter_ns()
            if i >= 100:
                rt.append((t1 - t0) / 1e3)
                answer.append((te - ts) / 1e3)
            while time.perf_counter_ns() - t1 < gap_us * 1e3:  # the GPU's segment until the next post
                pass
        ch.wait_response(ch.post(OP_STOP, 0, 0, 0, 0), timeout_s=5)
        ch.close(unlink=True)
        return {"round_trip_us_median": float(np.median(rt)), "answer_us_median": float(np.median(answer)),
                "round_trip_us_p90": float(np.percentile(rt, 90))}


def run_cpu_executor(a: argparse.Namespace) -> dict:
    """--cpu-executor: the CPU executor's actor answering FFN requests (see the module docstring)."""
    from powerinfer_ray.actors.executors import CPUExecutorActor
    from powerinfer_ray.model.planted_spec import preset_config
    from powerinfer_ray.runtime.plan import Plan

    spec = a.cpu_executor if a.cpu_executor.startswith("planted:") else "planted:" + a.cpu_executor
    cfg = preset_config(spec.removeprefix("planted:"))
    n_gpu = cfg.n_ff - round(a.cpu_share * cfg.n_ff)
    if not 0 < a.cpu_share <= 1 or not 0 <= a.k <= cfg.n_ff - n_gpu:
        raise SystemExit(f"--cpu-share {a.cpu_share} / --k {a.k}: expected a share in (0, 1] and k in [0, "
                         f"{cfg.n_ff - n_gpu}] (the rows of that share of {spec}'s {cfg.n_ff} neurons)")
    plan = Plan.from_masks([np.arange(cfg.n_ff) < n_gpu] * cfg.n_layer, None, cfg)
    cpu = CPUExecutorActor.options(num_cpus=1).remote("bench-cpu")
    ray.get(cpu.load.remote(spec, plan, threads=a.threads, dtype="f16"))
    prim = ExchangePrimary.options(num_cpus=1).remote()
    res = ray.get(prim.run.remote(cpu, cfg.n_layer, cfg.n_embd, cfg.n_ff - n_gpu, a.k, a.iters, a.gap_us))
    st = ray.get(cpu.stats.remote())
    n = st["decode_exchanges"]
    res.update(exchanges=n, answer_us_per_exchange=1e6 * st["decode_busy_s"] / n,
               kernel_us_per_exchange=1e6 * st["decode_kernel_s"] / n,
               serving_us_per_exchange=1e6 * (st["decode_busy_s"] - st["decode_kernel_s"]) / n,
               kernel_gbps=st["decode_kernel_bytes"] / st["decode_kernel_s"] / 1e9,
               model=spec, cpu_share=a.cpu_share, k=a.k, threads=a.threads, gap_us=a.gap_us, iters=a.iters)
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="powerinfer-ray bench sync")
    ap.add_argument("--d", type=int, default=5120)
    ap.add_argument("--n-mask", type=int, default=13824)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--cpu-executor", default=None, metavar="SPEC",
                    help="the peer is the CPU executor on this planted model's CPU shard (e.g. 'llama2-13b?layers=4')")
    ap.add_argument("--cpu-share", type=float, default=0.62, help="--cpu-executor: share of each layer's neurons on it")
    ap.add_argument("--k", type=int, default=256, help="--cpu-executor: active rows of each request")
    ap.add_argument("--threads", type=int, default=1, help="--cpu-executor: its kernel threads")
    ap.add_argument("--gap-us", type=float, default=100.0,
                    help="--cpu-executor: the primary's spin between an answer and the next post")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from model_bench import machine, write_results

    from powerinfer_ray.generate import init_ray

    init_ray()
    if a.cpu_executor:
        res = run_cpu_executor(a)
        print(json.dumps(res, indent=2))
        write_results(a.out_dir, a.name or "serve-loop-" + machine()["host"],
                      "powerinfer-ray bench sync " + " ".join(argv), result=res)
        return 0
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    peer = Peer.options(num_cpus=1).remote()
    prim = Primary.options(num_gpus=gpus, num_cpus=1).remote()
    res = ray.get(prim.run.remote(peer, a.d, a.n_mask, a.iters))
    # what a layer pays to synchronise: the round trip without the peer's own work (here a copy of
    # x into out; in the engine, the CPU executor's FFN, reported there as CPU compute)
    res.update(d=a.d, n_mask=a.n_mask, per_layer_sync_us=res["sync_us_median"])
    print(json.dumps(res, indent=2))
    write_results(a.out_dir, a.name or "sync-" + machine()["host"], "powerinfer-ray bench sync " + " ".join(argv),
                  result=res)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
