"""The decode step (one token per sequence) over fixed shapes, captured as CUDA graphs.

At decode sizes the host's launch time of eager PyTorch, not the GPU, sets the pace. A decode
step of B sequences has fixed shapes, so ``StepSegments`` computes the steps of the layer
schedule (``schedule.py``) without host syncs or shape changes:
  - the step's inputs (tokens, positions, slots) are copied by the first graph from pinned host
    memory into device buffers; attention reads positions and slots on the device and takes
    its rotary rows from a table (kernels.attention.head_attention_step);
  - the predictor's split and the sparse FFN keep their counts on the device (n_active), and the
    predictor's decisions go into the activation counters in place (``activity``); so does
    gate-first (the gate of every row in one GEMV, its packed split by |SiLU(g)| > t, the sparse
    FFN over the rows above the threshold taking their gate values from the GEMV);
  - the CPU executor's inputs (hidden state, bit-packed mask) are staged into the channel's
    pinned buffers by the graph itself, and its answer is copied back by the next graph;
  - with zero-copy (``cold.HostRows``) a share of the CPU shard's active neurons is split off on
    the device too (their bits stay clear in the CPU's mask) and computed by the primary from
    their rows in host memory, while the CPU executor computes the rest.
``DecodeGraphs`` captures the steps between two exchanges as one graph and replays them. After
a graph whose copies the CPU executor needs, the host records an event, launches the next graph
(the GPU's share of the layer), waits for the event and posts the request: CPU and GPU work in
parallel. On a CPU primary the same steps run eagerly (``schedule.run_eager``): one code path,
which the CPU tests check against the dense reference.

Dimension legend: B sequences (padded to the bucket), D hidden, V vocab.
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from ..kernels.attention import head_attention_step
from ..kernels.linear import linear
from ..kernels.predictor import active_of, pack_active_bits, packed_views, split_active_packed
from ..kernels.sparse_ffn import sparse_ffn
from .activity import ActivityCounts
from .cold import ColdRows
from .exchange import Exchange
from .layers import add_partials, ffn_bytes
from .schedule import Post, Step, run_eager, step_schedule
from .stats import ExecStats
from .weights import PrimaryWeights

GRAPH_POLICIES = ("predictor", "gate-first", "dense")
SAMPLE = 8  # GPU time of every 8th decode step is measured


class GraphCaptureError(RuntimeError):
    """Capturing the decode step failed (before anything ran): the caller falls back to eager."""


class StepSegments:
    """The schedule's steps for up to B sequences of one token, over persistent buffers; rows
    past the step's sequences are padding (the caches' scratch slot; no neuron active, so they
    cost no FFN work)."""

    def __init__(self, w: PrimaryWeights, exchange: Exchange | None, B: int, activity: ActivityCounts,
                 cold: ColdRows | None = None) -> None:
        self.w, self.ex, self.B, self.act = w, exchange, B, activity
        self.n_seq = self.n_tok = B
        dev, cfg, pin = w.device, w.cfg, w.device.type == "cuda"
        self.inp_host = torch.zeros(4, B, dtype=torch.long, pin_memory=pin)  # tokens, positions, slots, valid
        self.inp = torch.zeros(4, B, dtype=torch.long, device=dev)
        self.h = torch.zeros(B, cfg.n_embd, dtype=torch.float32, device=dev)  # the residual stream
        # (token, neuron) pairs and rows read: the primary's neurons, then the CPU's it computes (zero-copy)
        self.counts = torch.zeros(4, dtype=torch.int64, device=dev)
        self.logits_host = torch.zeros(B, cfg.n_vocab, dtype=torch.float32, pin_memory=pin)
        self.counts_host = torch.zeros(4, dtype=torch.int64, pin_memory=pin)
        self.cos = self.sin = None
        self.a = self.f = self.f_host = self.x_a = self.x_f = self.logits = None
        self.g_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.h_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # zero-copy's
        share = cold.share(B) if cold is not None and exchange is not None and w.policy.name == "predictor" else 0.0
        self.host = [cold.host_rows(l, share) if len(lp.cpu_neurons) else None for l, lp in enumerate(w.plan.layers)]
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
        self.inp_host.copy_(torch.tensor([list(tokens) + [0] * pad, start_pos, slots, [1] * n + [0] * pad]))
        if self.ex is not None:  # the CPU executor's heads read them
            self.ex.set_positions(slots, start_pos)

    def embed(self, s: Step) -> None:
        w = self.w
        self.inp.copy_(self.inp_host, non_blocking=True)
        tok, pos = self.inp[0], self.inp[1]
        self.h.copy_(w.embed(tok, pos))  # [B, D] fp32
        if w.rope_cos is not None:
            self.cos, self.sin = w.rope_cos[pos], w.rope_sin[pos]  # [B, n_rot/2]
        self.counts.zero_()

    def attn_in(self, s: Step) -> None:
        self.x_a = self.w.norm(self.h, self.w.layers[s.l].norm_attn)

    def stage_attn(self, s: Step) -> None:
        self.ex.stage_attn(self.x_a)

    def attention(self, s: Step) -> None:
        cfg, sh = self.w.cfg, self.w.layers[s.l].attn
        self.a = None
        if sh.n_groups:
            self.a = head_attention_step(self.x_a, sh.wqkv, sh.bqkv, sh.wo_t, sh.k_cache, sh.v_cache,
                                         self.inp[2], self.inp[1], self.cos, self.sin, cfg.rope_style,
                                         cfg.rot_dims, qtype=sh.qtype)

    def attn_out(self, s: Step) -> None:
        cpu = self.ex.collect(self.B) if s.cpu else None
        add_partials(self.h, [self.a, cpu], self.w.layers[s.l].attn_bias)

    def ffn_in(self, s: Step) -> None:
        """FFN norm, and the predictor's split: the GPU's active rows packed on the device."""
        w, lw = self.w, self.w.layers[s.l]
        self.x_f = w.norm(self.h, lw.norm_ffn) if lw.norm_ffn else self.x_a
        self.g_part = self.h_part = self.logits = None
        if w.policy.name == "gate-first" and self.B > 1:  # padding rows: a zero x passes no threshold here
            self.x_f = self.x_f.masked_fill(self.inp[3, :, None] == 0, 0.0)  # or on the CPU executor
        if w.policy.name != "predictor":
            return
        self.logits = w.predict(s.l, self.h)  # [B, n_gpu + n_cpu]
        if self.B > 1:  # padding rows activate nothing
            self.logits = self.logits.masked_fill(self.inp[3, :, None] == 0, float("-inf"))
        ng, thr = lw.ffn.n, w.policy.threshold
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
        self.ex.stage_ffn(self.x_f)
        if self.logits is not None:
            ng = self.w.layers[s.l].ffn.n
            hr = self.host[s.l]  # the neurons computed here stay clear
            packed = pack_active_bits(self.logits, self.w.policy.threshold, ng,
                                      skip=None if hr is None else hr.mine)  # [B, ceil(n_cpu/8)], one kernel
            self.ex.stage_mask(packed, self.logits.shape[1] - ng)

    def ffn(self, s: Step) -> None:
        w, sh = self.w, self.w.layers[s.l].ffn
        self.f = self.f_host = None
        t, on = w.policy.act_threshold(s.l), w.policy.act_on
        if self.h_part is not None:
            hs, (idx, bits, n_active) = self.host[s.l].shard, self.h_part
            self.f_host = sparse_ffn(self.x_f, hs.up, hs.gate, hs.down_t, idx, bits, w.cfg.ffn_act, hs.up_bias,
                                     n_active=n_active, qtype=hs.qtype, act_threshold=t, act_on=on)
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
        cpu = self.ex.collect(self.B) if s.cpu else None
        add_partials(self.h, [a, self.f, self.f_host, cpu], self.w.layers[s.l].ffn_bias)

    def head(self, s: Step) -> None:
        self.logits_host.copy_(self.w.head(self.h), non_blocking=True)  # [B, V]
        self.counts_host.copy_(self.counts, non_blocking=True)


class DecodeGraphs:
    """The decode step of up to B sequences as captured graphs (CUDA) or eager segments (CPU)."""

    def __init__(self, w: PrimaryWeights, exchange: Exchange | None, stats: ExecStats, B: int,
                 activity: ActivityCounts, cold: ColdRows | None = None) -> None:
        if w.policy.name not in GRAPH_POLICIES:
            raise ValueError(f"graph decode supports policies {GRAPH_POLICIES}, not {w.policy.name!r}")
        self.w, self.ex, self.stats, self.B = w, exchange, stats, B
        self.cuda = w.device.type == "cuda"
        self.seg = StepSegments(w, exchange, B, activity, cold)
        self.items = step_schedule(w.cfg, w.plan, w.policy.name)
        self.blocks = _blocks(self.items)  # [steps] (one graph each) | Post | Await
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.event = torch.cuda.Event() if self.cuda else None
        # every SAMPLE-th step times each graph replay with CUDA events: the GPU's compute time
        # per step, without the idle gaps while the CPU executor answers
        self.timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.n_steps = 0

    def _fns(self, steps: list[Step]) -> list:
        return [partial(getattr(self.seg, s.op), s) for s in steps]

    def _capture(self) -> None:
        """Run every segment once on a side stream (Triton compiles, cuBLAS picks its kernels),
        then capture each run of steps into its own graph, all in one private memory pool
        (replayed in capture order, so sharing the pool is safe)."""
        runs = [self._fns(b) for b in self.blocks if type(b) is list]
        dev = self.w.device
        counted = self.seg.act.flat.clone()  # the warm-up run counts nothing: the replay (or eager step) does
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(side):
                for fns in runs:
                    for fn in fns:
                        fn()
        finally:
            torch.cuda.current_stream(dev).wait_stream(side)
            self.seg.act.flat.copy_(counted)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for fns in runs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                for fn in fns:
                    fn()
            graphs.append(g)
        self.graphs = graphs

    def run(self, slots: list[int], tokens: list[int], start_pos: list[int]) -> np.ndarray:
        """One decode step of len(tokens) <= B sequences: logits [len(tokens), V] (float32)."""
        st, n = self.stats, len(tokens)
        self.seg.set_inputs(slots, tokens, start_pos)
        if self.cuda:
            self._replay()
        else:
            run_eager(self.items, self.seg, self.ex, st, lambda: None)
        pairs, rows, host_pairs, host_rows = (int(v) for v in self.seg.counts_host.tolist())
        st.neurons += pairs + self.seg.dense_pairs * n
        st.cold_neurons += host_pairs  # placed on the CPU: the GPU share counts them with the CPU's
        st.host_read_bytes += ffn_bytes(self.w.cfg, host_rows, host_rows, host_rows)
        rows += self.seg.dense_pairs
        gate_rows = self.seg.gpu_rows if self.w.policy.name == "gate-first" else rows
        st.active_bytes += ffn_bytes(self.w.cfg, gate_rows, rows, rows)
        return self.seg.logits_host[:n].numpy().copy()

    def _replay(self) -> None:
        st, dev = self.stats, self.w.device
        if self.graphs is None:
            t_c = time.perf_counter()
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001
                raise GraphCaptureError(f"{type(e).__name__}: {e}") from e
            st.graph_captures += 1
            st.capture_s += time.perf_counter() - t_c
        k, pending = 0, None  # pending: a post waiting for the next launch
        seq = t_post = 0
        timed = self.n_steps % SAMPLE == 0
        if timed and self.timers is None:
            self.timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in self.graphs]
        for it in self.blocks:
            if type(it) is list:
                t_l = time.monotonic_ns()
                if timed:
                    self.timers[k][0].record()
                self.graphs[k].replay()
                if timed:
                    self.timers[k][1].record()
                st.layer_s["launch"] += (time.monotonic_ns() - t_l) * 1e-9
                k += 1
                if pending is not None:
                    seq, t_post = self._post(pending)
                    pending = None
            elif type(it) is Post:
                self.event.record()
                pending = it
            else:
                if pending is not None:
                    seq, t_post = self._post(pending)
                    pending = None
                self.ex.await_(seq, t_post)
        torch.cuda.current_stream(dev).synchronize()
        if timed:
            st.gpu_compute_s += sum(a.elapsed_time(b) for a, b in self.timers) * 1e-3
            st.gpu_sampled_steps += 1
        self.n_steps += 1

    def _post(self, it: Post) -> tuple[int, int]:
        t0 = time.monotonic_ns()
        self.event.synchronize()  # the graph's copies into the channel are done
        self.stats.layer_s["gpu_wait"] += (time.monotonic_ns() - t0) * 1e-9
        return self.ex.post(it.op, it.l, self.B, self.B, it.n_mask)


def _blocks(items: list) -> list:
    """The schedule with each run of consecutive steps (between two exchanges) as one list."""
    blocks: list = []
    for it in items:
        if type(it) is not Step:
            blocks.append(it)
        elif blocks and type(blocks[-1]) is list:
            blocks[-1].append(it)
        else:
            blocks.append([it])
    return blocks
