"""The primary's decode step as fixed-shape segments, captured as CUDA graphs (one set per batch
size B) and replayed: one launch per segment instead of dozens of eager kernels.

Why: at decode sizes the host's launch time of eager PyTorch, not the GPU, set the pace
(bench/results/runtime-13b-16gib-h200-v2.json: 0.67 ms of host time per layer for attention
alone, where the GPU needs ~0.07). A decode step of B sequences, one token each, has fixed
shapes, so every run of GPU work between two exchanges with the CPU executor is captured once:
  - the step's inputs (tokens, positions, slots) are copied by the first graph from pinned host
    memory into device buffers; attention reads positions and slots on the device and takes
    its rotary rows from a table (kernels.attention.head_attention_step);
  - the predictor's split and the sparse FFN keep their counts on the device (n_active);
  - the CPU executor's inputs (hidden state, bit-packed mask) are copied into the channel's
    pinned buffers by the graph itself, and its answer is copied back by the next graph.

Per layer (sequential attention; parallel attention, as in Falcon, has one exchange):
    seg  merge of the previous layer | attention norm [| x_a -> channel]   (post OP_ATTN)
    seg  attention of the GPU's heads                                      (wait)
    seg  residual [+ CPU heads] | FFN norm | predictor | split [| x_f, mask -> channel]
                                                                           (post OP_FFN)
    seg  sparse FFN of the GPU's neurons                                   (wait)
Consecutive segments without an exchange between them form one graph. After a graph whose
copies the CPU executor needs, the host records an event, launches the next graph (the GPU's
share of the layer), waits for the event and posts the request: CPU and GPU work in parallel.

On a CPU primary the same segments run eagerly (nothing to capture): one code path, which the
CPU tests check against the dense reference.
"""
from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ..kernels.attention import head_attention_step
from ..kernels.predictor import pack_active_bits, packed_views, predictor_logits, split_active_packed
from ..kernels.sparse_ffn import sparse_ffn
from .channel import OP_ATTN, OP_ATTN_FFN, OP_FFN
from .layers import merge_partials

if TYPE_CHECKING:
    from .executor import PrimaryExecutor

GRAPH_POLICIES = ("predictor", "dense")
SAMPLE = 8  # GPU time of every 8th decode step is measured


class GraphCaptureError(RuntimeError):
    """Capturing the decode step failed (before anything ran): the caller falls back to eager."""


class DecodeGraphs:
    """The decode step of up to B sequences (T = 1) of one PrimaryExecutor as segments and
    exchanges; fewer sequences are padded to B."""

    def __init__(self, ex: PrimaryExecutor, B: int) -> None:
        if ex.policy not in GRAPH_POLICIES:
            raise ValueError(f"graph decode supports policies {GRAPH_POLICIES}, not {ex.policy!r}")
        self.ex, self.B, cfg = ex, B, ex.cfg
        dev = ex.device
        self.cuda = dev.type == "cuda"
        pin = self.cuda
        # tokens, positions, slots, valid: rows past the step's sequences are padding (slot: the
        # caches' scratch slot; no neuron active, so they cost no FFN work)
        self.inp_host = torch.zeros(4, B, dtype=torch.long, pin_memory=pin)
        self.inp = torch.zeros(4, B, dtype=torch.long, device=dev)
        self.h = torch.zeros(B, cfg.n_embd, dtype=torch.float32, device=dev)  # the residual stream
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)  # (token, neuron) pairs, rows read
        self.logits_host = torch.zeros(B, cfg.n_vocab, dtype=torch.float32, pin_memory=pin)
        self.counts_host = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        self.cos = self.sin = None
        self.a = self.f = self.x_a = self.x_f = None
        self.g_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.items = self._build()
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.event = torch.cuda.Event() if self.cuda else None
        # every SAMPLE-th step times each graph replay with CUDA events: the GPU's compute time
        # per step, without the idle gaps while the CPU executor answers
        self.timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.n_steps = 0
        self.dense_pairs = 0  # per step, policy 'dense': every GPU row for every token
        if ex.policy == "dense":
            self.dense_pairs = sum(lw.ffn.n for lw in ex.layers)

    # --- the segments ------------------------------------------------------------------------------
    def _build(self) -> list[tuple]:
        """[("run", [segment fns]) | ("post", op, layer, n_mask) | ("wait", layer)] in order."""
        ex, cfg = self.ex, self.ex.cfg
        items: list[tuple] = []

        def seg(fn: Callable[[], None]) -> None:
            if items and items[-1][0] == "run":
                items[-1][1].append(fn)
            else:
                items.append(("run", [fn]))

        seg(self._embed)
        merge_prev: tuple[int, bool] | None = None
        for l in range(cfg.n_layer):
            lp = ex.plan[l]
            cpu_heads, cpu_ffn = len(lp.cpu_groups) > 0, len(lp.cpu_neurons) > 0
            n_mask = len(lp.cpu_neurons) if ex.policy == "predictor" and cpu_ffn else 0
            if cfg.parallel_attn:
                seg(partial(self._pre_parallel, l, merge_prev, cpu_heads, cpu_ffn))
                if cpu_heads or cpu_ffn:  # one request: the CPU answers with the sum of its parts
                    items.append(("post", OP_ATTN_FFN if cpu_ffn else OP_ATTN, l, n_mask))
                seg(partial(self._attn, l))
                seg(partial(self._ffn, l))
                if cpu_heads or cpu_ffn:
                    items.append(("wait", l))
            else:
                seg(partial(self._pre_attn, l, merge_prev, cpu_heads))
                if cpu_heads:
                    items.append(("post", OP_ATTN, l, 0))
                seg(partial(self._attn, l))
                if cpu_heads:
                    items.append(("wait", l))
                seg(partial(self._pre_ffn, l, cpu_heads, cpu_ffn))
                if cpu_ffn:
                    items.append(("post", OP_FFN, l, n_mask))
                seg(partial(self._ffn, l))
                if cpu_ffn:
                    items.append(("wait", l))
            merge_prev = (l, cpu_ffn or (cfg.parallel_attn and cpu_heads))
        seg(partial(self._head, merge_prev))
        return items

    def _embed(self) -> None:
        ex, cfg = self.ex, self.ex.cfg
        self.inp.copy_(self.inp_host, non_blocking=True)
        tok, pos = self.inp[0], self.inp[1]
        self.h.copy_(ex.embd[tok])  # [B, D] fp32
        if ex.pos_embd is not None:
            self.h += ex.pos_embd[pos + cfg.pos_offset].float()
        if ex.rope_cos is not None:
            self.cos, self.sin = ex.rope_cos[pos], ex.rope_sin[pos]  # [B, n_rot/2]
        self.counts.zero_()

    def _cpu_out(self) -> torch.Tensor:
        """The CPU executor's partial output [B, D] (fp32), copied to the device."""
        return self.ex.channel.out[: self.B].to(self.ex.device, non_blocking=True)

    def _merge_ffn(self, merge_prev: tuple[int, bool] | None) -> None:
        """h += the previous layer's FFN (and, with parallel attention, attention) partials."""
        if merge_prev is None:
            return
        l, with_cpu = merge_prev
        lw = self.ex.layers[l]
        parts = [self.a, self.f] if self.ex.cfg.parallel_attn else [self.f]
        bias = lw.down_bias
        if self.ex.cfg.parallel_attn and lw.attn_out_bias is not None:
            bias = lw.attn_out_bias if bias is None else lw.attn_out_bias + bias
        self.h += merge_partials(parts + [self._cpu_out() if with_cpu else None], bias)

    def _copy_x(self, dst: torch.Tensor, x: torch.Tensor) -> None:
        dst[: self.B].copy_(x, non_blocking=True)

    def _pre_attn(self, l: int, merge_prev, cpu_heads: bool) -> None:  # noqa: ANN001
        self._merge_ffn(merge_prev)
        self.x_a = self.ex._norm(self.h, self.ex.layers[l].norm_attn)
        if cpu_heads:
            self._copy_x(self.ex.channel.x_attn, self.x_a)

    def _attn(self, l: int) -> None:
        cfg, sh = self.ex.cfg, self.ex.layers[l].attn
        self.a = None
        if sh.n_groups:
            self.a = head_attention_step(self.x_a, sh.wqkv, sh.bqkv, sh.wo_t, sh.k_cache, sh.v_cache,
                                         self.inp[2], self.inp[1], self.cos, self.sin, cfg.rope_style,
                                         cfg.rot_dims)

    def _predict(self, l: int, pred_in: torch.Tensor, cpu_ffn: bool) -> None:
        """The predictor: the GPU's active rows (packed, on the device) and the CPU's bit mask
        (into the channel)."""
        ex, lw = self.ex, self.ex.layers[l]
        ng = lw.ffn.n
        self.g_part = None
        if ex.policy != "predictor":
            return
        logits = predictor_logits(pred_in.to(ex.dtype), lw.fc1, lw.fc2)  # [B, n_gpu + n_cpu]
        if self.B > 1:  # padding rows activate nothing
            logits = logits.masked_fill(self.inp[3, :, None] == 0, float("-inf"))
        if ng:
            part = split_active_packed(logits, ex.threshold, ex.gpu_first[l], gpu_capacity=ng, cpu_capacity=0).gpu
            self.g_part = packed_views(part)  # idx, bits, n_active
            self.counts[0] += (logits[:, :ng] >= ex.threshold).sum()
            self.counts[1] += self.g_part[2][0]
        if cpu_ffn:
            packed = pack_active_bits(logits, ex.threshold, ng)  # [B, ceil(n_cpu/8)], one kernel
            torch.from_numpy(ex.channel.mask_rows(self.B, logits.shape[1] - ng)).copy_(packed, non_blocking=True)

    def _pre_ffn(self, l: int, cpu_heads: bool, cpu_ffn: bool) -> None:
        ex, lw = self.ex, self.ex.layers[l]
        self.h += merge_partials([self.a, self._cpu_out() if cpu_heads else None], lw.attn_out_bias)
        self.x_f = ex._norm(self.h, lw.norm_ffn)
        self._predict(l, self.h, cpu_ffn)
        if cpu_ffn:
            self._copy_x(ex.channel.x_ffn, self.x_f)

    def _pre_parallel(self, l: int, merge_prev, cpu_heads: bool, cpu_ffn: bool) -> None:  # noqa: ANN001
        ex, lw = self.ex, self.ex.layers[l]
        self._merge_ffn(merge_prev)
        self.x_a = ex._norm(self.h, lw.norm_attn)
        self.x_f = ex._norm(self.h, lw.norm_ffn) if lw.norm_ffn else self.x_a
        self._predict(l, self.h, cpu_ffn)
        if cpu_heads:
            self._copy_x(ex.channel.x_attn, self.x_a)
        if cpu_ffn:
            self._copy_x(ex.channel.x_ffn, self.x_f)

    def _ffn(self, l: int) -> None:
        ex, sh = self.ex, self.ex.layers[l].ffn
        self.f = None
        if not sh.n:
            return
        if ex.policy == "predictor":
            idx, bits, n_active = self.g_part
            self.f = sparse_ffn(self.x_f, sh.up, sh.gate, sh.down_t, idx, bits, ex.cfg.ffn_act, sh.up_bias,
                                n_active=n_active)
        else:
            self.f = sparse_ffn(self.x_f, sh.up, sh.gate, sh.down_t, ex.all_rows[l], None, ex.cfg.ffn_act,
                                sh.up_bias)

    def _head(self, merge_prev) -> None:  # noqa: ANN001
        ex = self.ex
        self._merge_ffn(merge_prev)
        logits = (ex._norm(self.h, ex.out_norm) @ ex.out_w.T).float()  # [B, V]
        self.logits_host.copy_(logits, non_blocking=True)
        self.counts_host.copy_(self.counts, non_blocking=True)

    # --- capture and replay ------------------------------------------------------------------------
    def _capture(self) -> None:
        """Run every segment once on a side stream (Triton compiles, cuBLAS picks its kernels),
        then capture each run of segments into its own graph, all in one private memory pool
        (replayed in capture order, so sharing the pool is safe)."""
        runs = [it[1] for it in self.items if it[0] == "run"]
        side = torch.cuda.Stream(self.ex.device)
        side.wait_stream(torch.cuda.current_stream(self.ex.device))
        with torch.cuda.stream(side):
            for fns in runs:
                for fn in fns:
                    fn()
        torch.cuda.current_stream(self.ex.device).wait_stream(side)
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
        ex, st = self.ex, self.ex.stats
        n, pad = len(tokens), self.B - len(tokens)
        slots = list(slots) + [ex.slots] * pad  # the scratch slot
        start_pos = list(start_pos) + [0] * pad
        self.inp_host.copy_(torch.tensor([list(tokens) + [0] * pad, start_pos, slots, [1] * n + [0] * pad]))
        if ex.channel is not None:  # the CPU executor's heads read them
            ex.channel.slots[: self.B] = slots
            ex.channel.start_pos[: self.B] = start_pos
        if self.cuda and self.graphs is None:
            t_c = time.perf_counter()
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001
                raise GraphCaptureError(f"{type(e).__name__}: {e}") from e
            st.graph_captures += 1
            st.capture_s += time.perf_counter() - t_c
        k = 0
        pending = None  # a post waiting for the next launch
        seq = t_post = 0
        timed = self.cuda and self.n_steps % SAMPLE == 0
        if timed and self.timers is None:
            self.timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in self.graphs]
        for it in self.items:
            if it[0] == "run":
                if self.cuda:
                    t_l = time.monotonic_ns()
                    if timed:
                        self.timers[k][0].record()
                    self.graphs[k].replay()
                    if timed:
                        self.timers[k][1].record()
                    st.layer_s["launch"] += (time.monotonic_ns() - t_l) * 1e-9
                else:
                    for fn in it[1]:
                        fn()
                k += 1
                if pending is not None:
                    seq, t_post = self._post(*pending)
                    pending = None
            elif it[0] == "post":
                if self.cuda:
                    self.event.record()
                pending = it[1:]
            else:
                if pending is not None:
                    seq, t_post = self._post(*pending)
                    pending = None
                ex.await_peer(seq, t_post)
        if self.cuda:
            torch.cuda.current_stream(ex.device).synchronize()
        if timed:
            st.gpu_compute_s += sum(a.elapsed_time(b) for a, b in self.timers) * 1e-3
            st.gpu_sampled_steps += 1
        self.n_steps += 1
        pairs, rows = (int(v) for v in self.counts_host.tolist())
        st.neurons += pairs + self.dense_pairs * n
        st.active_bytes += (rows + self.dense_pairs) * ex.cfg.neuron_bytes
        return self.logits_host[:n].numpy().copy()

    def _post(self, op: int, l: int, n_mask: int) -> tuple[int, int]:
        t0 = time.monotonic_ns()
        if self.cuda:
            self.event.synchronize()  # the graph's copies into the channel are done
        t1 = time.monotonic_ns()
        self.ex.stats.layer_s["gpu_wait"] += (t1 - t0) * 1e-9
        return self.ex.channel.post(op, l, self.B, self.B, n_mask), t1
