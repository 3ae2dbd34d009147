"""The CPU executor: it holds the cold neurons and the CPU-placed attention heads, and answers
the primary's per-layer requests over the shared-memory channel, in a loop (``serve``).

Dimension legend: N tokens of an exchange, D hidden.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, wait as futures_wait
from typing import Any, Callable

import numpy as np
import torch

from ..kernels.cpu_ffn import BitmaskCall, ServeLoop, linear as cpu_linear, prepare_bitmask
from ..kernels.cpu_library import available as kernels_available, configure_threads
from ..model import gguf_keys as K
from ..model.qtypes import row_bytes
from ..model.source import WeightSource, file_mapping, open_model
from .activity import ActivityCounts, cpu_counts
from .channel import OP_ATTN, OP_ATTN_FFN, OP_FFN, OP_PING, OP_STOP, Channel, ChannelSpec
from .cores import CoreClaim
from .hostmem import process_memory
from .layers import Policy, attn_partial, ffn_bytes, ffn_partial
from .plan import Plan, Swap
from .schedule import mask_width
from .shard import (FFNShard, ffn_qtype, in_place_attn_shard, in_place_ffn_shard, load_attn_shard,
                    load_ffn_shard, replace_neurons)
from .sharedshard import fill, prefault, release, share
from .stats import ExecStats
from .warm import Warmer, warm_rows
from .weights import DTYPES

log = logging.getLogger(__name__)
# how long the FFN kernel's worker threads spin after an exchange before they sleep: longer than the
# gap between two layers' exchanges and between decode steps, so while tokens are generated they
# start each exchange at once, on cores that never fell asleep
WORKER_SPIN_US = 5000
# how long the serving loop spins without a request before it sleeps (hot while generating)
SPIN_S = 0.02


class OneThread:
    """Runs callables one after another in a single daemon thread (``call`` waits for the result,
    ``submit`` returns a Future; exceptions travel with them). Not ThreadPoolExecutor(1): its
    worker is joined at interpreter exit, and the serving loop it would run ends only on OP_STOP.

    The CPU executor runs all of its torch and kernel work here because libgomp (torch's OpenMP
    runtime) keeps a pool of worker threads per thread that starts parallel regions: with two such
    threads the pools outnumber the cores, and libgomp then puts its workers to sleep between
    regions instead of letting them spin. (The compiled kernels' own workers, kernels/csrc/pool.h,
    take their caller as thread 0: this thread.)"""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001  (the caller gets it)
                    fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:  # noqa: ANN401
        return self.submit(fn).result()

    def close(self) -> None:
        """The thread ends after what was submitted before."""
        self._q.put(None)


def _log_failure(fut: Future) -> None:
    """The serving loop ended with an exception (the primary then times out waiting): say why."""
    if not fut.cancelled() and fut.exception() is not None:
        log.error("cpu executor: the serving loop failed", exc_info=fut.exception())


class CPUExecutor:
    """Cold neurons and CPU-placed heads; answers the primary's per-layer requests. Everything it
    computes (loading included) runs in its one worker thread (`OneThread`)."""

    def __init__(self, model: str | WeightSource, plan: Plan, *, policy: str = "predictor",
                 slots: int = 8, n_ctx: int | None = None, threads: int | None = None,
                 dtype: str | None = None, defer_fill: bool = False) -> None:
        """defer_fill: when the FFN rows go to a shared file, lay it out and leave the rows for
        the primary to write (`PrimaryExecutor.fill_cold`, then `filled`)."""
        t0 = time.perf_counter()
        self._omp = OneThread("cpu-executor")
        self._serving: Future | None = None
        try:
            self._omp.call(lambda: self._load(model, plan, policy, slots, n_ctx, threads, dtype, defer_fill))
        except BaseException:
            self._omp.close()
            raise
        self.load_s = time.perf_counter() - t0  # reading (or generating) its shard

    def _load(self, model, plan, policy, slots, n_ctx, threads, dtype, defer_fill) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        self.src = open_model(model)
        self.cfg = cfg = self.src.config
        self.plan, self.policy = plan, policy
        self.pol = Policy.for_model(policy, None, cfg)  # the SwiGLU activation thresholds it applies
        # policy 'dense' reads every row in full, down rows of zero activations too, as a dense
        # FFN (llama.cpp) does: it is the layer-offload baseline
        self.skip_zero = policy != "dense"
        self.threads = threads or torch.get_num_threads()
        self._cpus = sorted(os.sched_getaffinity(0))  # before any pinning of this thread
        self.claim = CoreClaim()  # the cores it pins to, apart from other engines' on this host
        # loading (a planted model's rows are generated) runs torch's threads on every CPU of the
        # process, before this thread is pinned for serving (``_apply_threads``, below)
        torch.set_num_threads(self.threads)
        wdt = DTYPES[dtype or cfg.float_dtype]
        n_ctx = min(n_ctx or cfg.n_ctx, cfg.n_ctx)
        self.phases = {"open": time.perf_counter() - t0}
        t1 = time.perf_counter()
        self.shard_spec, self.needs_fill = None, False
        self.ffn = self._ffn_in_place(wdt)
        if self.ffn is None:
            self.ffn = self._ffn_copy(wdt, defer_fill)
        self.phases["ffn"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        # attention weights in the model's dtype, read in place by the compiled kernel's linear
        # (fp32 weights read twice the bytes; torch would widen them per call); KV cache in fp32
        # (in place in the file's mapping when its groups are one range)
        self.attn = [in_place_attn_shard(self.src, l, plan[l].cpu_groups, wdt, slots + 1, n_ctx, torch.float32)
                     or load_attn_shard(self.src, l, plan[l].cpu_groups, wdt, torch.device("cpu"), slots + 1, n_ctx,
                                        cache_dtype=torch.float32, out_rows=True) for l in range(cfg.n_layer)]
        self.phases["attention"] = time.perf_counter() - t1
        self._stats = ExecStats()
        self._loop: ServeLoop | None = None  # the compiled serving loop (``attach``)
        # policy 'oracle': the true activity of the rows it computes (``activity``; the primary
        # counts the tokens and, under 'predictor', decides these neurons itself)
        self.activity = ActivityCounts([lp.cpu_neurons for lp in plan.layers], "cpu", cpu_counts(policy))
        self.channel: Channel | None = None
        self._calls: dict[tuple[int, int], Callable] = {}  # the FFN kernel's call per (layer, mask width)
        self.error: str | None = None
        self.warmer = Warmer(self.ffn).start() if self.ffn_rows == "file" else None
        t1 = time.perf_counter()
        self._apply_threads()  # loads the compiled kernels (built on a host's first start, then cached)
        self.phases["kernels"] = time.perf_counter() - t1

    def _ffn_in_place(self, wdt: torch.dtype) -> list[FFNShard] | None:
        """Every layer's FFN rows as views of the model file's memory map (no copy), or None
        when the source has no file or its layout or dtype cannot be read so."""
        cfg, plan = self.cfg, self.plan
        shards = [in_place_ffn_shard(self.src, l, plan[l].cpu_neurons, wdt) for l in range(cfg.n_layer)]
        if any(sh is None for sh in shards):
            return None
        self.ffn_rows = "file"
        log.info("cpu executor: FFN rows computed in place in %s (%.2f GiB of rows, no copy)",
                 file_mapping(self.src).path, sum(sh.nbytes for sh in shards) / 2**30)
        return shards

    def _ffn_copy(self, wdt: torch.dtype, defer_fill: bool) -> list[FFNShard]:
        """The FFN rows copied (float rows in wdt, or a quantized model's blocks): into one
        shared-memory file when /dev/shm has room (the primary maps the same pages for dense
        prefill instead of holding a second copy: runtime/sharedshard.py), else into private memory."""
        cfg, plan, dev = self.cfg, self.plan, torch.device("cpu")
        qtype = ffn_qtype(self.src)
        why = ("the source has no file (a planted model: its rows are generated)" if file_mapping(self.src) is None
               else f"the file does not hold every layer's ffn_up / ffn_gate / ffn_down_t as {qtype or wdt} [n_ff, D] rows")
        load = lambda l: load_ffn_shard(self.src, l, plan[l].cpu_neurons, wdt, dev)  # noqa: E731
        shared = share([len(plan[l].cpu_neurons) for l in range(cfg.n_layer)], cfg.gated,
                       cfg.n_embd if qtype is None else row_bytes(qtype, cfg.n_embd),
                       wdt if qtype is None else torch.uint8, load,
                       defer=self._ids_and_bias if defer_fill else None, qtype=qtype)
        self.ffn_rows = "shared" if shared is not None else "private"
        shards = shared[0] if shared is not None else [load(l) for l in range(cfg.n_layer)]
        log.info("cpu executor: FFN rows copied into %s memory (%.2f GiB): %s", self.ffn_rows,
                 sum(sh.nbytes for sh in shards) / 2**30, why)
        if shared is not None:
            self.shard_spec, self.needs_fill = shared[1], defer_fill
        return shards

    def ready(self) -> dict:
        """What the group's start script reads: the shared rows' layout, and whether they await
        their rows (``defer_fill``); where the FFN rows are (file | shared | private), the load's
        phases in seconds, and this process's memory."""
        return {"device": "cpu", "weight_bytes": self.weight_bytes(), "threads": self.threads, "pinned": self.pinned,
                "load_s": self.load_s, "needs_fill": self.needs_fill, "shard_spec": self.shard_spec,
                "ffn_rows": self.ffn_rows, "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "memory": self.memory()}

    def memory(self) -> dict:
        """This process's resident memory (``hostmem.process_memory``), the bytes of its FFN rows
        by where they are, and how far the warming of in-place rows has come."""
        rows = sum(sh.nbytes for sh in self.ffn)
        return {**process_memory(), "ffn_rows": self.ffn_rows, "ffn_row_bytes": rows,
                "shared_bytes": rows if self.ffn_rows == "shared" else 0,
                "warm": self.warmer.state() if self.warmer is not None else None}

    def weight_bytes(self) -> int:
        return sum(s.nbytes for s in self.ffn) + sum(a.weight_bytes + a.cache_bytes for a in self.attn)

    def set_threads(self, n: int) -> int:
        """Threads of the next requests' kernels and torch ops (live: the serving loop applies it
        per request); for tuning against the other processes spinning on the host's cores."""
        if not isinstance(n, int) or not 1 <= n <= (os.cpu_count() or 1):
            raise ValueError(f"threads={n!r}: expected an int in [1, {os.cpu_count()}] (this host's cores)")
        self.threads = n
        if self._serving is None:
            self._omp.call(self._apply_threads)
        elif self._loop is not None:
            self._loop.interrupt()  # the compiled loop hands its next request to Python, which applies n
        return n

    def _apply_threads(self) -> None:
        """The kernels' workers, and torch's threads, for serving: the workers pinned to the last
        ``threads`` CPUs of this process that no other engine on the host holds (``cores``), when
        at least two more are left for the others (the primary's driver thread, Ray), so they spin
        on cores of their own; else unpinned (they
        yield when a core is shared). Runs in the worker thread, which becomes the kernels' thread
        0. Pinned, torch runs this thread's few ops (the attention's rotary, softmax and cache
        writes) in this thread alone: a thread starts with its creator's CPUs, so the OpenMP
        workers a pinned thread starts would share its one core, and the other pinned cores are
        the kernels' workers', spinning after each call. Unpinned, torch gets ``threads``."""
        self.pinned = self.claim.take(self.threads, self._cpus)
        torch.set_num_threads(1 if self.pinned else self.threads)
        configure_threads(WORKER_SPIN_US, self.pinned)

    def _ids_and_bias(self, l: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Layer l's CPU neurons and their up bias (float32, models with biases): the shared
        file's layout without the rows."""
        ids = np.asarray(self.plan[l].cpu_neurons, np.int64)
        if not self.cfg.bias or not len(ids):
            return ids, None
        return ids, self.src.layer(K.FFN_UP, l, rows=ids, dtype=torch.float32, bias=True).numpy()

    def filled(self, by_primary: bool = True) -> None:
        """The primary has written the rows (`needs_fill`): touch every page once before serving.
        by_primary False: it could not, so write them here."""
        def run() -> None:
            t0 = time.perf_counter()
            if not by_primary:
                fill(self.shard_spec, self.src, torch.device("cpu"))
            prefault(self.ffn)
            self.phases["fill" if not by_primary else "prefault"] = time.perf_counter() - t0
        self._omp.call(run)
        self.needs_fill = False

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                qtype: str | None = None) -> torch.Tensor:
        """The attention projections: fp32 x, weights read in place by the kernel's threads."""
        return cpu_linear(x, w, b, self.threads, qtype=qtype)

    def attach(self, spec: ChannelSpec) -> int:
        """Map the primary's channel and serve it in the worker thread until OP_STOP (the caller
        stays responsive); every request posted after this call is served. Returns our pid."""
        self.channel = Channel.attach(spec)
        self._calls.clear()  # they were prepared for the channel's buffers
        last = int(self.channel.header[0])  # read here, not when the worker gets to it
        self._serving = self._omp.submit(lambda: self.serve(last))
        self._serving.add_done_callback(_log_failure)
        return os.getpid()

    @property
    def stats(self) -> ExecStats:
        """Its counters: the answers of the Python loop, and of the compiled one (``serve``)."""
        loop = self._loop
        if loop is None:
            return self._stats
        c, st, cfg = loop.totals(), self._stats, self.cfg
        nbytes = ffn_bytes(cfg, c["rows"], c["up_rows"], c["down_rows"])
        return dataclasses.replace(
            st, exchanges=st.exchanges + c["exchanges"], tokens=st.tokens + c["tokens"], neurons=st.neurons + c["pairs"],
            active_bytes=st.active_bytes + nbytes, kernel_bytes=st.kernel_bytes + nbytes,
            busy_s=st.busy_s + c["busy_ns"] * 1e-9, kernel_s=st.kernel_s + c["kernel_ns"] * 1e-9,
            decode_exchanges=st.decode_exchanges + c["decode_exchanges"],
            decode_busy_s=st.decode_busy_s + c["decode_busy_ns"] * 1e-9,
            decode_kernel_s=st.decode_kernel_s + c["decode_kernel_ns"] * 1e-9,
            decode_kernel_bytes=st.decode_kernel_bytes + ffn_bytes(cfg, c["decode_rows"], c["decode_up_rows"],
                                                                   c["decode_down_rows"]),
            compiled_exchanges=st.compiled_exchanges + c["exchanges"])

    def _serve_loop(self) -> ServeLoop | None:
        """The compiled serving loop over every layer's FFN call, prepared now; None where the
        Python loop serves alone: no compiled kernels, policy 'oracle' (it finds its own active
        set), or a primary in this process (it waits on a condition variable the loop cannot ring)."""
        ch = self.channel
        if ch.in_process or self.policy == "oracle" or not kernels_available():
            return None
        widths = [mask_width(self.policy, sh.n) for sh in self.ffn]  # the requests' n_mask
        calls = [self._prepared(l, w) if self.ffn[l].n > 0 else None for l, w in enumerate(widths)]
        return ServeLoop(ch.header, calls, widths, ch.spec.t_max)

    def serve(self, last: int) -> None:
        """Answer the channel's requests until OP_STOP. The compiled loop (``_serve_loop``) answers
        the FFN requests it can; the rest come back here: the other ops, a request after an idle
        spell (then asleep), after ``set_threads``."""
        ch = self.channel
        applied = self.threads  # applied at load, or by set_threads before serving
        torch.set_grad_enabled(False)  # this thread's mode (no autograd in what it serves), not a context per call
        self._stats = self.stats  # a loop of an earlier channel (served until OP_STOP): its counters kept
        loop = self._loop = self._serve_loop()
        if loop is not None:
            loop.configure(self.threads, SPIN_S)
        while True:
            if loop is not None:
                last, pending = loop.run(last)
                if not pending:
                    last = ch.wait_request(last, spin_s=0.0)
                loop.clear()  # before reading the threads: a set_threads from here on interrupts the next run
            else:
                last = ch.wait_request(last, spin_s=SPIN_S)  # hot while generating, asleep when idle
            t_start = time.monotonic_ns()
            if self.threads != applied:  # set_threads while serving
                self._apply_threads()
                applied = self.threads
                if loop is not None:
                    loop.configure(self.threads, SPIN_S)
            op, l, n_seq, n_tok, n_mask = ch.request()
            if op == OP_STOP:
                ch.respond(last, t_start)
                return
            ok = True
            st, k_s, k_bytes = self._stats, self._stats.kernel_s, self._stats.kernel_bytes
            try:
                if op != OP_PING:
                    self._compute(op, l, n_seq, n_tok, n_mask)
            except Exception:  # report to the primary, keep serving  # noqa: BLE001
                log.exception("cpu executor: layer %d failed", l)
                self.error, ok = f"layer {l} failed", False
            ch.respond(last, t_start, ok)
            busy = (time.monotonic_ns() - t_start) * 1e-9
            st.busy_s += busy
            if op != OP_PING and n_tok == n_seq:  # one token per sequence: a decode step's exchange
                st.decode_exchanges += 1
                st.decode_busy_s += busy
                st.decode_kernel_s += st.kernel_s - k_s
                st.decode_kernel_bytes += st.kernel_bytes - k_bytes

    def _compute(self, op: int, l: int, n_seq: int, n_tok: int, n_mask: int) -> None:
        ch, cfg = self.channel, self.cfg
        # the partial outputs are written (and summed) in place in ch.out[:n_tok] [N, D] (x's dtype)
        wrote = op in (OP_FFN, OP_ATTN_FFN) and self.ffn[l].n > 0
        if wrote:
            self._ffn(l, n_tok, n_mask)
        if op in (OP_ATTN, OP_ATTN_FFN) and self.attn[l].n_groups:
            x = ch.x_attn[:n_tok].float().view(n_seq, n_tok // n_seq, cfg.n_embd)
            slots, start = ch.slots[:n_seq].tolist(), ch.start_pos[:n_seq].tolist()
            t_a = time.monotonic_ns()
            a = attn_partial(x, self.attn[l], cfg, slots, start, self._linear).view(n_tok, cfg.n_embd)
            self._stats.attn_s += (time.monotonic_ns() - t_a) * 1e-9
            ch.out[:n_tok].add_(a) if wrote else ch.out[:n_tok].copy_(a)
            self._stats.active_bytes += self.attn[l].weight_bytes  # read in full by every step
            wrote = True
        if not wrote:
            ch.out[:n_tok].zero_()
        self._stats.exchanges += 1
        self._stats.tokens += n_tok if l == 0 else 0

    def _ffn(self, l: int, n_tok: int, n_mask: int) -> None:
        """Layer l's FFN share of the channel's x_ffn, written to its out [N, D]."""
        ch, cfg, sh = self.channel, self.cfg, self.ffn[l]
        if self.policy == "oracle":  # finds its own active set: the general path
            y, pairs, rows = ffn_partial(ch.x_ffn[:n_tok].float(), sh, cfg.ffn_act, self.policy, None,
                                         threads=self.threads, act_threshold=self.pol.act_threshold(l),
                                         act_on=self.pol.act_on, count=self.activity.layers[l])
            ch.out[:n_tok].copy_(y)
            nbytes = ffn_bytes(cfg, rows, rows, rows)
        else:  # one compiled call from the channel's packed mask and x to out (gate-first: every row, gate first)
            t_k = time.monotonic_ns()
            counts = self._prepared(l, n_mask)(n_tok, self.threads)
            self._stats.kernel_s += (time.monotonic_ns() - t_k) * 1e-9
            pairs, rows, down_rows = counts[:3]
            up_rows = counts[3] if len(counts) > 3 else rows  # gate first: only rows whose gate passes
            # bytes read (as stored: blocks of a quantized model); the rows it skipped are not read
            nbytes = ffn_bytes(cfg, rows, up_rows, down_rows)
            self._stats.kernel_bytes += nbytes
        self._stats.neurons += pairs
        self._stats.active_bytes += nbytes

    def _prepared(self, l: int, n_mask: int) -> BitmaskCall:
        """Layer l's FFN call on the channel's buffers at their capacity (checked once per layer
        and mask width: ``prepare_bitmask``)."""
        call = self._calls.get((l, n_mask))
        if call is None:
            ch, sh = self.channel, self.ffn[l]
            packed = ch.mask_rows(ch.spec.t_max, n_mask) if self.policy == "predictor" else None
            call = self._calls[(l, n_mask)] = prepare_bitmask(
                ch.x_ffn, sh.up, sh.gate, sh.down_t, packed, n_mask if packed is not None else sh.n,
                self.cfg.ffn_act, sh.up_bias, ch.out, skip_zero=self.skip_zero, qtype=sh.qtype, rows=sh.rows,
                act_threshold=self.pol.act_threshold(l), act_on=self.pol.act_on)
        return call

    def swap(self, swaps: list[Swap]) -> None:
        """Re-placement (``runtime.replacement``), between steps (the primary swaps the same, and
        posts nothing meanwhile: no request is in flight): each swap's ``to_cpu`` neurons take the
        shard's rows ``cpu_rows``; in the file's map that is a change of row ids (their pages
        mapped now), in a copy their rows written over the leaving ones. The channel's mask bits
        are rows of the shard, so they mean the new neurons from the next request on."""
        t0 = time.perf_counter()
        for s in swaps:
            sh = self.ffn[s.l]
            replace_neurons(self.src, s.l, sh, s.cpu_rows, s.to_cpu)
            if sh.in_place:
                warm_rows(sh, s.to_cpu)
            self.activity.relabel(s.l, s.cpu_rows, s.to_cpu, self.cfg.n_ff)
            self.plan = self.plan.swap(s)
        self._stats.moved_neurons += sum(len(s) for s in swaps)
        self._stats.move_s += time.perf_counter() - t0

    def activation_counts(self, reset: bool = False) -> np.ndarray:
        """The true activity counts of its neurons under policy 'oracle' [L, n_ff] by model neuron
        id (int64; zero elsewhere and under other policies); reset: start afresh."""
        counts = self.activity.model_counts(self.cfg.n_ff)
        if reset:
            self.activity.reset()
        return counts

    def stop(self) -> None:
        """After the serving loop answered OP_STOP (or never started): end the worker thread and
        let go of the shared rows (their pages stay while the primary maps them)."""
        if self._serving is not None:
            futures_wait([self._serving], timeout=5)
        self._omp.close()
        self.claim.release()
        if self.warmer is not None:
            self.warmer.stop()
        release(self.shard_spec)
