"""The decode step (one token per sequence) over fixed shapes, captured as CUDA graphs.

At decode sizes the host's launch time of eager PyTorch, not the GPU, sets the pace. A decode
step of B sequences has fixed shapes, so ``StepSegments`` computes the steps of the layer
schedule (``schedule.py``) without host syncs or shape changes:
  - the step's inputs (tokens, positions, slots) are copied by the first graph from pinned host
    memory into device buffers (or, where the host set none, taken from the step before: its
    argmax at the next positions); attention reads positions and slots on the device and takes
    its rotary rows from a table (kernels.attention.head_attention_step);
  - the predictor's split and the sparse FFN keep their counts on the device (n_active), and the
    predictor's decisions go into the activation counters in place (``activity``); so does
    gate-first (the gate of every row in one GEMV, its packed split by |SiLU(g)| > t, the sparse
    FFN over the rows above the threshold taking their gate values from the GEMV);
  - the CPU executor's inputs (hidden state, bit-packed mask) are written into the channel's
    page-locked buffers by the graph's own kernels, and its answer is read in place by the next
    norm's kernel: no copy-engine node in the graph (each cost ~10 us of gaps around it);
  - a layer's partial outputs wait in ``pending`` until the next step reads the residual: the
    next RMS norm adds them in its own kernel (``PrimaryWeights.add_norm``);
  - with zero-copy (``cold.HostRows``) a share of the CPU shard's active neurons is split off on
    the device too (their bits stay clear in the CPU's mask) and computed by the primary from
    their rows in host memory, while the CPU executor computes the rest. Where the share is the
    default, a bucket's steps are captured with it and without it, and ``ShareChoice`` runs the
    set whose steps measure faster: which side is faster depends on the host (its PCIe reads and
    its CPU kernel's rate differ between hosts of one kind, bench/RESULTS.md).
``DecodeGraphs`` captures the whole step, the exchanges included, as a few graphs (``_chunks``),
one set per batch-size bucket (``buckets``), every set at the engine's start and in one memory pool
(``PrimaryExecutor.capture_graphs``), so no capture ever delays a step that serves requests:
after the copies that stage a request, a kernel posts it in the channel's page-locked header, and
where the answer is needed a kernel polls the header until the CPU executor has written it
(``kernels.triton_signal``). The host launches the graphs and waits for the step's end; between
the CPU's answer and the GPU's next kernel no host thread, launch or poll stands. The GPU computes
its share of a layer while the CPU computes its own. A step's argmax, counts and GPU times go
into a pinned ring of two rows, and its argmax with the next positions into the inputs the next step
takes unless the host sets new ones: a greedy burst (``run_burst``) launches each step before the one
ahead of it has ended, so the GPU runs them back to back and the host's wait, reads and launches lie
beside them. On a CPU primary the same steps run eagerly (``schedule.run_eager``): one code path,
which the CPU tests check against the dense reference.

Dimension legend: B sequences (padded to the bucket), D hidden, V vocab.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from contextlib import contextmanager
from functools import cached_property
from typing import Any, Iterator

import numpy as np
import torch

from ..kernels.attention import head_attention_step
from ..kernels.linear import linear
from ..kernels.predictor import active_of, pack_active_bits, packed_views, split_active_packed
from ..kernels.sparse_ffn import sparse_ffn
from .activity import ActivityCounts
from .channel import ABORTED, device_view
from .cold import ColdRows
from .exchange import ChannelBuffers, Exchange
from .layers import ffn_bytes
from .schedule import Post, Step, run_eager, step_schedule
from .stats import ExecStats
from .weights import Norm, PrimaryWeights

GRAPH_POLICIES = ("predictor", "gate-first", "dense")
CHUNK_STARTS = (1, 4, 16)  # layers that begin a new graph of the step (``_chunks``)


def bucket_of(n_seq: int, slots: int) -> int:
    """The graph set that runs a decode step of n_seq sequences: n_seq padded to a power of two,
    at most ``slots`` (few sets to capture)."""
    return min(1 << (n_seq - 1).bit_length(), slots)


def buckets(slots: int) -> list[int]:
    """Every bucket a decode step of 1..slots sequences can take (``bucket_of``), ascending."""
    return sorted({bucket_of(n, slots) for n in (1 << k for k in range(slots.bit_length() + 1))})


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: what a collection frees inside a CUDA
    graph capture (objects of an engine closed before, say) can call into CUDA, which a capture
    forbids, and the process aborts."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

class GraphCaptureError(RuntimeError):
    """Capturing the decode step failed (before anything ran): the caller falls back to eager."""


class StepSegments:
    """The schedule's steps for up to B sequences of one token, over persistent buffers; rows
    past the step's sequences are padding (the caches' scratch slot; no neuron active, so they
    cost no FFN work)."""

    def __init__(self, w: PrimaryWeights, exchange: Exchange | None, B: int, activity: ActivityCounts,
                 cold: ColdRows | None = None, share: float = 0.0) -> None:
        """share: of the CPU shard's active neurons, computed here from their rows in host memory
        (``ColdRows.host_rows``; the caller's choice, ``PrimaryExecutor.decode_shares``)."""
        self.w, self.ex, self.B, self.act = w, exchange, B, activity
        self.n_seq = self.n_tok = B
        dev, cfg, pin = w.device, w.cfg, w.device.type == "cuda"
        # the step's inputs: tokens, positions, slots, valid; as the host sets them (pinned, with the
        # count of inputs set in row 4), as copied in, the step's own, and the next step's (``head``)
        self.inp_host = torch.zeros(5, B, dtype=torch.long, pin_memory=pin)
        self.inp_in = torch.zeros(5, B, dtype=torch.long, device=dev)
        self.inp = torch.zeros(4, B, dtype=torch.long, device=dev)
        self.inp_next = torch.zeros(5, B, dtype=torch.long, device=dev)
        self.inputs_set = 0
        self.h = torch.zeros(B, cfg.n_embd, dtype=torch.float32, device=dev)  # the residual stream
        # (token, neuron) pairs and rows read: the primary's neurons, then the CPU's it computes (zero-copy)
        self.counts = torch.zeros(4, dtype=torch.int64, device=dev)
        self.logits_host = torch.zeros(B, cfg.n_vocab, dtype=torch.float32, pin_memory=pin)
        self.ids = torch.zeros(B, dtype=torch.int64, device=dev)  # the logits' argmax (greedy next tokens)
        self.cpu_heads = exchange is not None and any(len(lp.cpu_groups) for lp in w.plan.layers)
        self.cos = self.sin = None
        self.a = self.f = self.f_host = self.x_a = self.x_f = self.logits = None
        self.g_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.h_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # zero-copy's
        # partial outputs not yet in h, with their bias: added by the next step that reads h (a
        # norm adds them in its own kernel)
        self.pending: tuple[list[torch.Tensor | None], torch.Tensor | None] | None = None
        self.host = [cold.host_rows(l, share) if share and len(lp.cpu_neurons) else None
                     for l, lp in enumerate(w.plan.layers)]
        # per step, policy 'dense': every GPU row for every token
        self.dense_pairs = sum(lw.ffn.n for lw in w.layers) if w.policy.name == "dense" else 0
        self.gpu_rows = sum(lw.ffn.n for lw in w.layers)  # gate-first reads all of their gate rows
        # gate-first's split: every neuron of the shard is this device's
        self.all_here = [torch.ones(lw.ffn.n, dtype=torch.bool, device=dev) for lw in w.layers] \
            if w.policy.name == "gate-first" else None

    def set_inputs(self, slots: list[int], tokens: list[int], start_pos: list[int]) -> None:
        """The step's sequences, padded to B (pinned host buffer: the first graph copies it)."""
        n, pad = len(tokens), self.B - len(tokens)
        slots = list(slots) + [self.w.slots] * pad  # the scratch slot
        start_pos = list(start_pos) + [0] * pad
        self.inputs_set += 1
        self.inp_host.copy_(torch.tensor([list(tokens) + [0] * pad, start_pos, slots, [1] * n + [0] * pad,
                                          [self.inputs_set] * self.B]))
        if self.ex is not None:  # the CPU executor's heads read them
            self.ex.set_positions(slots, start_pos)

    def embed(self, s: Step) -> None:
        w = self.w
        # the inputs the host set, if it set new ones since the step before; else that step's next
        self.inp_in.copy_(self.inp_host, non_blocking=True)
        self.inp.copy_(torch.where(self.inp_in[4:] != self.inp_next[4:], self.inp_in[:4], self.inp_next[:4]))
        tok, pos = self.inp[0], self.inp[1]
        self.h.copy_(w.embed(tok, pos))  # [B, D] fp32
        if w.rope_cos is not None:
            self.cos, self.sin = w.rope_cos[pos], w.rope_sin[pos]  # [B, n_rot/2]
        self.counts.zero_()

    def _residual(self, pair: Norm | None = None) -> torch.Tensor | None:
        """h += the pending partial outputs and bias; with a norm, returns the norm of h."""
        parts, bias = self.pending or ([], None)
        self.pending = None
        return self.w.add_norm(self.h, [p for p in parts if p is not None], bias, pair)

    @cached_property
    def ch(self) -> ChannelBuffers:
        """The channel's buffers as this device's kernels address them (read at the first use: on
        CUDA inside the capture, whose failure falls back to eager steps)."""
        return self.ex.buffers()

    def _stage(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """x into the channel: on CUDA by a kernel's stores over PCIe (no copy-engine node)."""
        if x.is_cuda:
            from ..kernels.triton_signal import store_rows
            store_rows(x.to(dst.dtype).contiguous(), dst)
        else:
            dst.copy_(x)

    def attn_in(self, s: Step) -> None:
        self.x_a = self._residual(self.w.layers[s.l].norm_attn)

    def stage_attn(self, s: Step) -> None:
        self._stage(self.x_a, self.ch.x_attn[:self.B])

    def attention(self, s: Step) -> None:
        cfg, sh = self.w.cfg, self.w.layers[s.l].attn
        self.a = None
        if sh.n_groups:
            self.a = head_attention_step(self.x_a, sh.wqkv, sh.bqkv, sh.wo_t, sh.k_cache, sh.v_cache,
                                         self.inp[2], self.inp[1], self.cos, self.sin, cfg.rope_style,
                                         cfg.rot_dims, qtype=sh.qtype)

    def attn_out(self, s: Step) -> None:
        cpu = self.ch.out[:self.B] if s.cpu else None  # read in place by the next norm's kernel
        self.pending = ([self.a, cpu], self.w.layers[s.l].attn_bias)

    def ffn_in(self, s: Step) -> None:
        """FFN norm and the predictor's logits (the CPU's mask is packed from them by ``stage_ffn``;
        this device's split waits for ``ffn``, after the CPU's request is posted)."""
        w, lw = self.w, self.w.layers[s.l]
        self.x_f = self._residual(lw.norm_ffn) if lw.norm_ffn else self._residual() or self.x_a
        self.g_part = self.h_part = self.logits = None
        if w.policy.name == "gate-first" and self.B > 1:  # padding rows: a zero x passes no threshold here
            self.x_f = self.x_f.masked_fill(self.inp[3, :, None] == 0, 0.0)  # or on the CPU executor
        if w.policy.name != "predictor":
            return
        self.logits = w.predict(s.l, self.h)  # [B, n_gpu + n_cpu]
        if self.B > 1:  # padding rows activate nothing
            self.logits = self.logits.masked_fill(self.inp[3, :, None] == 0, float("-inf"))

    def _split(self, s: Step) -> None:
        """The predictor's split of this device's neurons: its active rows packed on the device."""
        w, ng, thr = self.w, self.w.layers[s.l].ffn.n, self.w.policy.threshold
        # one kernel on CUDA: the split of the primary's neurons, the activity counters of every
        # neuron (padding rows are -inf: none active) and the step's pairs and rows
        part = split_active_packed(self.logits, thr, w.gpu_first[s.l], gpu_capacity=ng, cpu_capacity=0,
                                   activity=self.act.layers[s.l] if self.act.on else None, stats=self.counts[:2]).gpu
        self.g_part = packed_views(part) if ng else None  # idx, bits, n_active
        hr = self.host[s.l]
        if hr is not None:  # the CPU's neurons computed here: ids are their rows in host memory
            part = split_active_packed(self.logits[:, ng:], thr, hr.mine, local_of=hr.local, gpu_capacity=hr.n,
                                       cpu_capacity=0, stats=self.counts[2:]).gpu
            self.h_part = packed_views(part)

    def stage_ffn(self, s: Step) -> None:
        self._stage(self.x_f, self.ch.x_ffn[:self.B])
        if self.logits is not None:
            ng = self.w.layers[s.l].ffn.n
            nb = (self.logits.shape[1] - ng + 7) // 8
            hr = self.host[s.l]  # the neurons computed here stay clear
            pack_active_bits(self.logits, self.w.policy.threshold, ng, skip=None if hr is None else hr.mine,
                             out=self.ch.mask[:self.B * nb].view(self.B, nb))  # one kernel, into the channel

    def ffn(self, s: Step) -> None:
        w, sh = self.w, self.w.layers[s.l].ffn
        if self.logits is not None:  # off the critical path: the CPU computes its share meanwhile
            self._split(s)
        self.f = self.f_host = None
        t, on = w.policy.act_threshold(s.l), w.policy.act_on
        if self.h_part is not None:
            hs, (idx, bits, n_active) = self.host[s.l].shard, self.h_part
            self.f_host = sparse_ffn(self.x_f, hs.up, hs.gate, hs.down_t, idx, bits, w.cfg.ffn_act, hs.up_bias,
                                     n_active=n_active, qtype=hs.qtype, act_threshold=t, act_on=on, host=True)
        if not sh.n:
            return
        if w.policy.name == "predictor":
            idx, bits, n_active = self.g_part
            self.f = sparse_ffn(self.x_f, sh.up, sh.gate, sh.down_t, idx, bits, w.cfg.ffn_act, sh.up_bias,
                                n_active=n_active, qtype=sh.qtype, act_threshold=t, act_on=on)
        elif w.policy.name == "gate-first":
            g = linear(self.x_f, sh.gate, qtype=sh.qtype)  # [B, n] fp32: the gate of every row, read once
            part = split_active_packed(g, t, self.all_here[s.l], gpu_capacity=sh.n, cpu_capacity=0, silu=True).gpu
            idx, bits, n_active = packed_views(part)
            self.f = sparse_ffn(self.x_f, sh.up, None, sh.down_t, idx, bits, w.cfg.ffn_act, sh.up_bias,
                                n_active=n_active, qtype=sh.qtype, gate_pre=g)
            self.counts[0] += active_of(g, t, silu=True).sum()
            self.counts[1] += n_active[0]
        else:
            self.f = sparse_ffn(self.x_f, sh.up, sh.gate, sh.down_t, w.all_rows[s.l], None, w.cfg.ffn_act,
                                sh.up_bias, qtype=sh.qtype)

    def ffn_out(self, s: Step) -> None:
        a = self.a if self.w.cfg.parallel_attn else None
        cpu = self.ch.out[:self.B] if s.cpu else None
        self.pending = ([a, self.f, self.f_host, cpu], self.w.layers[s.l].ffn_bias)

    def head(self, s: Step) -> None:
        """The logits (copied out) and their argmax; then the next step's inputs, should the host set
        none (``DecodeGraphs.run_burst``): each sequence's argmax at its next position (padding rows
        keep theirs), and those positions in the channel, where the CPU's heads read them."""
        self._residual()
        logits = self.w.head(self.h)  # [B, V]
        torch.argmax(logits, dim=-1, out=self.ids)
        self.logits_host.copy_(logits, non_blocking=True)
        inp = self.inp
        self.inp_next.copy_(torch.stack([self.ids, inp[1] + inp[3], inp[2], inp[3], self.inp_in[4]]))
        if self.cpu_heads:
            self._stage(self.inp_next[1], self.ch.start_pos[:self.B])


class DecodeGraphs:
    """The decode step of up to B sequences as captured graphs (CUDA) or eager steps (CPU)."""

    def __init__(self, w: PrimaryWeights, exchange: Exchange | None, stats: ExecStats, B: int,
                 activity: ActivityCounts, cold: ColdRows | None = None, pool: Any = None,  # noqa: ANN401
                 side: torch.cuda.Stream | None = None, share: float = 0.0) -> None:
        """pool, side (CUDA): the graph memory pool and the stream of the capture's warm-up run,
        shared by every bucket's set (one pool: a step's temporaries are reused by the next
        bucket's; one stream: one cuBLAS workspace). share: zero-copy's (``StepSegments``)."""
        if w.policy.name not in GRAPH_POLICIES:
            raise ValueError(f"graph decode supports policies {GRAPH_POLICIES}, not {w.policy.name!r}")
        self.w, self.ex, self.stats, self.B = w, exchange, stats, B
        self.cuda = w.device.type == "cuda"
        self.seg = StepSegments(w, exchange, B, activity, cold, share)
        self.share = share
        self.items = step_schedule(w.cfg, w.plan, w.policy.name)
        self.chunks = _chunks(self.items)
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.pool, self.side = pool, side
        posts = [it for it in self.items if type(it) is Post]
        # the GPU's clock (ns): the step's start, per post (posted, began to wait, saw the answer), its end
        self.stamps = torch.zeros(2 + 3 * len(posts), dtype=torch.int64, device=w.device)
        # each step's results, [ids (B) | counts (4) | stamps | serial], in row serial % 2 of a pinned ring
        # (``_publish``): a step chained after it (``run_burst``) writes the other row
        self.serial = torch.zeros(1, dtype=torch.int64, device=w.device)  # steps published
        self.published = 0  # the host's count of them
        self.ring = torch.zeros(2, B + 4 + self.stamps.numel() + 1, dtype=torch.int64, pin_memory=self.cuda)
        # the last call's steps' times: the GPU's clock from the first to the last kernel (CPU: the host's)
        self.step_ns: list[int] = []
        if self.cuda:
            # each post's request fields: op, layer, n_seq, n_tok, n_mask
            self.fields = torch.tensor([[p.op, p.l, B, B, p.n_mask] for p in posts] or [[0] * 5], dtype=torch.int64,
                                       device=w.device)
            self.ring_dev = device_view(self.ring)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]  # of the steps in flight, in turn
            self.launched = 0

    def _record(self, c: int, k: int, header: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
        """Chunk c of the step on the current stream, posts and awaits included (``header``:
        req_seq, resp_seq and the request fields: ``Exchange.header_on_device``); k: the
        number of posts before it. Returns the number after it."""
        from ..kernels import triton_signal as signal

        req, resp, fields = header
        st = self.stamps
        if c == 0:
            signal.stamp(st[0:1])
        for it in self.chunks[c]:
            if type(it) is Step:
                getattr(self.seg, it.op)(it)
            elif type(it) is Post:
                signal.post_request(req, fields, self.fields[k], st[1 + 3 * k:])
                k += 1
            else:
                signal.await_answer(req, resp, st[2 + 3 * (k - 1):])
        if c == len(self.chunks) - 1:
            signal.stamp(st[-1:])
            self._publish()
        return k

    def _publish(self) -> None:
        """The step's results into the ring's row serial % 2, serial counting this step."""
        seg = self.seg
        self.serial += 1
        row = torch.cat([seg.ids, seg.counts, self.stamps, self.serial])
        (self.ring_dev if self.cuda else self.ring).index_copy_(0, self.serial % 2, row[None])

    def _record_all(self, header: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[torch.cuda.CUDAGraph]:
        """The step as one graph per chunk, in one memory pool (replayed in capture order)."""
        pool, graphs, k = self.pool or torch.cuda.graph_pool_handle(), [], 0
        with collector_paused():
            for c in range(len(self.chunks)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):  # it collects first
                    k = self._record(c, k, header)
                graphs.append(g)
        return graphs

    def capture(self) -> None:
        """Capture the step's graphs (CUDA; on the CPU the segments run eagerly: nothing to do),
        over padding rows only (the scratch slot: no sequence's cache is touched); raises
        GraphCaptureError, before any exchange or replay, when that fails."""
        if not self.cuda or self.graphs is not None:
            return
        self.seg.set_inputs([], [], [])
        try:
            self._capture()
        except Exception as e:  # noqa: BLE001
            raise GraphCaptureError(f"{type(e).__name__}: {e}") from e

    def _capture(self) -> None:
        """Run the step once on a side stream (Triton compiles, cuBLAS picks its kernels), its posts
        and awaits on a scratch header that answers at once, then capture its chunks' graphs on
        the channel's header."""
        dev = self.w.device
        scratch = torch.zeros(8, dtype=torch.int64, device=dev)
        scratch[1] = ABORTED  # every await ends at once
        counted = self.seg.act.flat.clone()  # the warm-up run counts nothing: the replay does
        side = self.side or torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        warm = (scratch[0:1], scratch[1:2], scratch[2:7])
        try:
            with torch.cuda.stream(side):
                k = 0
                for c in range(len(self.chunks)):
                    k = self._record(c, k, warm)
        finally:
            torch.cuda.current_stream(dev).wait_stream(side)
            self.seg.act.flat.copy_(counted)
        self.graphs = self._record_all(self.ex.header_on_device() if self.ex is not None else warm)
        self.published = int(self.serial.item())  # the warm-up run's

    def run(self, slots: list[int], tokens: list[int], start_pos: list[int], argmax: bool = False) -> np.ndarray:
        """One decode step of len(tokens) <= B sequences: logits [len(tokens), V] (float32), or
        with ``argmax`` their argmax [len(tokens)] (int64), found on the device."""
        self.seg.set_inputs(slots, tokens, start_pos)
        ids = self._steps(len(tokens), 1)[0]
        return ids if argmax else self.seg.logits_host[:len(tokens)].numpy().copy()

    def run_burst(self, slots: list[int], tokens: list[int], start_pos: list[int], n: int) -> np.ndarray:
        """n decode steps of len(tokens) <= B sequences, each taking the argmax of the one before as
        its token (greedy): the tokens [n, len(tokens)] (int64). On CUDA the next step's graphs are
        launched before this one's results are read, so the GPU runs the steps back to back: the
        host's time between them (its wait, reading results, the launch) is off the critical path."""
        self.seg.set_inputs(slots, tokens, start_pos)
        return self._steps(len(tokens), n)

    def _steps(self, n_seq: int, n: int) -> np.ndarray:
        """n steps from the inputs set (each next one's from the step before: ``StepSegments.head``);
        the argmax of each [n, n_seq]."""
        out = np.empty((n, n_seq), dtype=np.int64)
        self.step_ns = []
        if not self.cuda:
            for j in range(n):
                t0 = time.monotonic_ns()
                run_eager(self.items, self.seg, self.ex, self.stats, lambda: None)
                self._publish()
                out[j] = self._results(n_seq, host_ns=time.monotonic_ns() - t0)
            return out
        assert self.graphs is not None, f"the decode graphs of {self.B} sequences were never captured"
        counters = self.ex.channel.counters() if self.ex is not None else None
        pending = [self._launch()]
        try:
            for j in range(n):
                if j + 1 < n:
                    pending.append(self._launch())
                peer_ns, counters = self._wait(pending.pop(0), counters)
                out[j] = self._results(n_seq, peer_ns=peer_ns)
        except BaseException:
            for ev in pending:  # no step left in flight (a dead peer's waits ended: Exchange.wait_step)
                try:
                    self._wait(ev, counters)
                except Exception:  # noqa: BLE001
                    pass
            raise
        return out

    def _launch(self) -> torch.cuda.Event:
        """Launch the step's graphs; the event its end reaches."""
        t0 = time.monotonic_ns()
        for g in self.graphs:
            g.replay()
        ev = self.events[self.launched % 2]
        ev.record()
        self.launched += 1
        self.stats.layer_s["launch"] += (time.monotonic_ns() - t0) * 1e-9
        return ev

    def _wait(self, ev: torch.cuda.Event, counters: tuple | None) -> tuple[int, tuple | None]:
        """Wait for a launched step's end (``Exchange.wait_step``: raises when the CPU executor died,
        failed or went silent); the channel's requests since ``counters`` are counted. Returns the
        peer's ns over them and the counters now."""
        if self.ex is None:
            ev.synchronize()
            return 0, None
        n_req, _, peer_ns = grown = self.ex.wait_step(ev, counters)
        self.stats.exchanges += n_req
        self.stats.peer_compute_s += peer_ns * 1e-9
        return peer_ns, tuple(a + b for a, b in zip(counters, grown))

    def _results(self, n_seq: int, peer_ns: int = 0, host_ns: int = 0) -> np.ndarray:
        """The next published step's results (the ring's row): its counts and times into the stats
        (``exchange``: from a post until the GPU saw the answer, less ``peer_ns`` the peer's compute
        in it, ``segment``: the rest of the step, by the GPU's clock; CPU: the step's host time
        ``host_ns``); its argmax [n_seq]."""
        st, B = self.stats, self.B
        self.published += 1
        row = self.ring[self.published % 2].numpy()
        if row[-1] != self.published:
            raise RuntimeError(f"decode step {self.published}'s results were overwritten by step {row[-1]}")
        ids, (pairs, rows, host_pairs, host_rows), s = row[:n_seq].copy(), row[B:B + 4], row[B + 4:-1]
        if self.cuda:
            posted, waited, seen = s[1:-1:3], s[2:-1:3], s[3:-1:3]
            exchange, spin, total = int((seen - posted).sum()), int((seen - waited).sum()), int(s[-1] - s[0])
            st.layer_s["exchange"] += exchange * 1e-9
            st.layer_s["segment"] += (total - exchange) * 1e-9
            if self.ex is not None:
                st.sync_s += (exchange - peer_ns) * 1e-9  # the round trips beyond the peer's compute
            st.gpu_compute_s += (total - spin) * 1e-9
            st.gpu_timed_steps += 1
        else:
            total = host_ns
        self.step_ns.append(total)
        key = f"{self.share:g}"
        st.share_steps[key] = st.share_steps.get(key, 0) + 1
        st.neurons += int(pairs) + self.seg.dense_pairs * n_seq
        st.cold_neurons += int(host_pairs)  # placed on the CPU: the GPU share counts them with the CPU's
        st.host_read_bytes += ffn_bytes(self.w.cfg, int(host_rows), int(host_rows), int(host_rows))
        rows = int(rows) + self.seg.dense_pairs
        gate_rows = self.seg.gpu_rows if self.w.policy.name == "gate-first" else rows
        st.active_bytes += ffn_bytes(self.w.cfg, gate_rows, rows, rows)
        return ids


class ShareChoice:
    """One bucket's decode graph sets, captured at different zero-copy shares, run by their steps'
    measured times (``DecodeGraphs.step_ns``). Each set is measured in blocks of BLOCK steps in a
    row, the first SETTLE of a block not counted: a step run right after one of the other set was
    measured faster than in a run of its own (on an H100 host a share that lost 3 % in steady runs
    won the steps alternated one by one). Blocks alternate until each set has ROUNDS; then the set
    with the lowest median over its last steps runs, and every RECHECK steps a block of the set run
    least recently does, so the choice follows the host while it serves. Costs no step a capture;
    at batch 1 a recheck block on a set 25 % slower costs under 1 %."""

    BLOCK, SETTLE, ROUNDS, RECHECK = 8, 2, 2, 256

    def __init__(self, sets: list[DecodeGraphs]) -> None:
        self.sets, self.B = sets, sets[0].B
        window = self.ROUNDS * (self.BLOCK - self.SETTLE)
        self.times = [deque(maxlen=window) for _ in sets]  # ns of each set's last counted steps
        self.blocks = [0] * len(sets)  # blocks measured of each set
        self.ran = [-1] * len(sets)  # the step each set last ran
        self.cur, self.left, self.settle, self.since, self.n = 0, 0, 0, 0, 0

    def pick(self) -> int:
        """The set the next step runs on (see the class)."""
        if self.left == 0:
            if min(self.blocks) < self.ROUNDS:
                nxt, self.left = self.blocks.index(min(self.blocks)), self.BLOCK
            elif self.since >= self.RECHECK:
                nxt, self.left, self.since = self.ran.index(min(self.ran)), self.BLOCK, 0
            else:
                nxt = min(range(len(self.sets)), key=lambda i: statistics.median(self.times[i]))
            if nxt != self.cur or self.n == 0:
                self.settle = self.SETTLE
            self.cur = nxt
        return self.cur

    def run(self, slots: list[int], tokens: list[int], start_pos: list[int], argmax: bool = False) -> np.ndarray:
        i = self.pick()
        out = self.sets[i].run(slots, tokens, start_pos, argmax)
        self._ran(i)
        return out

    def run_burst(self, slots: list[int], tokens: list[int], start_pos: list[int], n: int) -> np.ndarray:
        """``DecodeGraphs.run_burst`` in runs of one set: each picked for the rest of its block, or
        between blocks for BLOCK steps at most (none past the next recheck)."""
        out, done, cur, pos = [], 0, list(tokens), list(start_pos)
        while done < n:
            i = self.pick()
            m = min(n - done, self.left or min(self.BLOCK, max(self.RECHECK - self.since, 1)))
            out.append(self.sets[i].run_burst(slots, cur, pos, m))
            self._ran(i)
            done, cur, pos = done + m, list(out[-1][-1]), [p + m for p in pos]
        return np.concatenate(out)

    def _ran(self, i: int) -> None:
        """Count the steps set i just ran (``DecodeGraphs.step_ns``)."""
        for ns in self.sets[i].step_ns:
            if self.settle:
                self.settle -= 1
            else:
                self.times[i].append(ns)
            if self.left:
                self.left -= 1
                self.blocks[i] += self.left == 0
            self.ran[i], self.n, self.since = self.n, self.n + 1, self.since + 1


def _chunks(items: list) -> list[list]:
    """The step's items in chunks, one graph each, that start with layers 0, 1, 4, 16 (and the
    last with the head): a graph's launch takes host time in proportion to its kernels, and the
    GPU starts a graph once it is launched, so the first graph is short, and each next one is
    launched while the GPU computes the ones before it."""
    chunks: list[list] = [[]]
    for it in items:
        if type(it) is Step and it.op == "attn_in" and it.l in CHUNK_STARTS:
            chunks.append([])
        chunks[-1].append(it)
    return [c for c in chunks if c]
