"""The executors as plain classes (the Ray actors in ``actors/`` are thin shells over these).

``PrimaryExecutor`` drives the GPU (or, on a host without one, runs on the CPU: one code path,
placed by device). It holds the embeddings, norms, output head, the predictors, its shard of
neurons and heads, and runs every layer: attention, predictor, hot neurons, and the merge of
its partial outputs with the CPU executor's, which it gets through the shared-memory channel.

Decode steps (one token per sequence) of a CUDA primary run as captured CUDA graphs
(``graphs.DecodeGraphs``, one set per batch-size bucket); prefill chunks and the other cases run
the eager per-layer code below (``_layer``), which the graph segments mirror.

``CPUExecutor`` holds the cold neurons and CPU-placed heads and answers the primary's per-layer
requests in a loop (``serve``), spinning on the channel's flags.

Dimension legend: B sequences, T tokens per sequence in a step, N = B*T, D hidden, V vocab,
n neurons of a shard, r predictor width.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as Fn

from ..kernels.cpu_ffn import linear as cpu_linear, sparse_ffn_bitmask
from ..kernels.predictor import predictor_logits
from ..model import gguf_keys as K
from ..model.reference import ffn_activation, layer_norm, rms_norm
from ..model.source import WeightSource, open_model
from .channel import OP_ATTN, OP_ATTN_FFN, OP_FFN, OP_PING, OP_STOP, Channel, ChannelSpec, pack_mask, pin_host
from .graphs import GRAPH_POLICIES, DecodeGraphs, GraphCaptureError
from .layers import POLICIES, attn_partial, ffn_partial, merge_partials
from .plan import Plan
from .shard import AttnShard, FFNShard, load_attn_shard, load_ffn_shard
from .sharedshard import SharedShardSpec, attach, fill, prefault, release, share

log = logging.getLogger(__name__)
_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class ExecStats:
    """Counters an executor keeps; ``stats()`` reports them and the actors export them."""

    steps: int = 0
    tokens: int = 0
    neurons: int = 0  # (token, neuron) pairs computed
    # weight bytes read: active rows once per step (the CPU executor's kernel: without the down rows it
    # skipped, zero activations; the GPU's counts them), attention in full
    active_bytes: int = 0
    busy_s: float = 0.0
    exchanges: int = 0
    sync_s: float = 0.0  # notify + return latency + host copies, summed over exchanges
    peer_compute_s: float = 0.0
    peer_neurons: int = 0
    # the CPU shard's neurons this device computed densely (long prompts): placed on the CPU,
    # so the GPU share of activations counts them with the CPU's
    cold_neurons: int = 0
    gpu_compute_s: float = 0.0  # GPU time of the decode graphs (CUDA events), on sampled steps
    gpu_sampled_steps: int = 0
    graph_captures: int = 0  # decode graph sets captured (a new batch bucket; Triton compiles included)
    capture_s: float = 0.0  # and the host seconds they took
    kernel_s: float = 0.0  # CPU executor: inside the FFN kernel call (the rest of an answer is Python)
    attn_s: float = 0.0  # CPU executor: in the attention of its KV-head groups
    # host seconds: attn / ffn of eager steps, wait for the CPU's answers, gpu_wait of graph
    # steps (for the GPU's segment to finish before a post), launch (inside graph replay calls)
    layer_s: dict[str, float] = field(default_factory=lambda: {"attn": 0.0, "ffn": 0.0, "wait": 0.0, "gpu_wait": 0.0,
                                                               "launch": 0.0})

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["layer_s"] = dict(self.layer_s)
        d["per_exchange_sync_us"] = 1e6 * self.sync_s / self.exchanges if self.exchanges else 0.0
        tot = self.neurons + self.peer_neurons + self.cold_neurons
        d["gpu_activation_share"] = self.neurons / tot if tot else 0.0
        return d


@dataclass
class LayerWeights:
    """The per-layer tensors only the primary holds."""

    norm_attn: tuple[torch.Tensor, torch.Tensor | None]
    norm_ffn: tuple[torch.Tensor, torch.Tensor | None] | None  # None: falcon single norm
    attn_out_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    fc1: torch.Tensor | None  # [r, D]
    fc2: torch.Tensor | None  # [n_gpu + n_cpu, r]: the primary's neurons' rows, then the CPU's
    ffn: FFNShard
    attn: AttnShard


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PrimaryExecutor:
    """Runs the whole per-layer pipeline on its device, with the CPU executor as its partner."""

    def __init__(self, model: str | WeightSource, plan: Plan, *, device: str = "cpu",
                 policy: str = "predictor", threshold: float | None = None, slots: int = 8,
                 n_ctx: int | None = None, t_max: int = 128, dtype: str | None = None,
                 timeout_s: float = 60.0, prefill_dense_min: int | None = None,
                 graphs: bool | None = None) -> None:
        self.src = open_model(model)
        self.cfg = cfg = self.src.config
        plan.verify(cfg)
        if policy not in POLICIES:
            raise ValueError(f"predictor policy {policy!r}: expected one of {POLICIES}")
        if policy == "predictor" and not cfg.has_predictors:
            raise ValueError(f"policy 'predictor' needs a model with predictors; {cfg.name or 'this model'} "
                             "has none: train them (powerinfer-ray train-predictors) or use policy 'dense'")
        self.plan, self.policy, self.timeout_s = plan, policy, timeout_s
        self.threshold = cfg.sparse_threshold if threshold is None else threshold
        self.threshold = 0.0 if self.threshold is None else float(self.threshold)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype or (cfg.dtype if self.device.type == "cuda" else "f32")]
        # KV caches hold slots + 1 sequences: the last one is scratch for padded decode rows
        self.slots, self.n_ctx, self.t_max = slots, min(n_ctx or cfg.n_ctx, cfg.n_ctx), t_max
        self.stats = ExecStats()
        self.channel: Channel | None = None
        # prompts of at least this many tokens run the CPU shard's neurons densely on this
        # device, streaming their rows from pinned host memory (upstream: dense prefill)
        self._prefill_auto = prefill_dense_min is None
        self.prefill_dense_min = (32 if self.device.type == "cuda" else 0) if prefill_dense_min is None \
            else prefill_dense_min
        # decode steps (one token per sequence) as captured CUDA graphs (graphs.py); on a CPU
        # device True runs the same fixed-shape segments eagerly (what the CPU tests check)
        self.use_graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        self.use_graphs = self.use_graphs and policy in GRAPH_POLICIES
        self._graphs: dict[int, DecodeGraphs] = {}
        if self.device.type == "cuda":
            # cuDNN's SDPA plans per shape: every decode step has a new key length, and the
            # re-plan costs ~8 ms of host time per call (measured on the H200 host)
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._load()

    # --- loading ---------------------------------------------------------------------------------
    def _vec(self, tmpl: str, l: int | None, bias: bool = False) -> torch.Tensor | None:
        name = K.global_tensor(tmpl, bias) if l is None else K.tensor(tmpl, l, bias)
        if not self.src.has(name):
            return None
        if l is None:
            return self.src.global_(tmpl, torch.float32, bias).to(self.device)
        return self.src.layer(tmpl, l, dtype=torch.float32, bias=bias, device=self.device)

    def _norm_pair(self, tmpl: str, l: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._vec(tmpl, l), self._vec(tmpl, l, bias=True)

    def _load(self) -> None:
        cfg, dev, dt = self.cfg, self.device, self.dtype
        self.embd = self.src.global_(K.TOKEN_EMBD, dt).to(dev)  # [V, D]
        self.pos_embd = self.src.global_(K.POS_EMBD, dt).to(dev) if cfg.arch == "opt" else None
        self.out_norm = self._norm_pair(K.OUTPUT_NORM, None)
        self.out_w = self.embd if cfg.tied_output else self.src.output_weight(dt).to(dev)  # [V, D]
        self.layers: list[LayerWeights] = []
        for l in range(cfg.n_layer):
            lp = self.plan[l]
            norm_ffn_t = K.ATTN_NORM_2 if cfg.two_norms else (None if cfg.parallel_attn else K.FFN_NORM)
            fc1 = fc2 = None
            if self.policy == "predictor":
                fc1 = self.src.layer(K.FC1, l, dtype=dt, device=dev)
                rows = np.concatenate([lp.gpu_neurons, lp.cpu_neurons])
                fc2 = self.src.layer(K.FC2, l, rows=rows, dtype=dt, device=dev)
            self.layers.append(LayerWeights(
                norm_attn=self._norm_pair(K.ATTN_NORM, l),
                norm_ffn=self._norm_pair(norm_ffn_t, l) if norm_ffn_t else None,
                attn_out_bias=self._vec(K.ATTN_OUT, l, bias=True),
                down_bias=self._vec(K.FFN_DOWN_T, l, bias=True),
                fc1=fc1, fc2=fc2,
                ffn=load_ffn_shard(self.src, l, lp.gpu_neurons, dt, dev),
                attn=load_attn_shard(self.src, l, lp.gpu_groups, dt, dev, self.slots + 1, self.n_ctx)))
            log.debug("primary: layer %d loaded", l)
        # what the graph decode step reads: rotary rows of every position, the predictor's
        # GPU rows (they come first in fc2), every GPU row (policy 'dense')
        self.rope_cos = self.rope_sin = None
        if cfg.rope_style is not None:
            from ..kernels.attention import rope_table
            self.rope_cos, self.rope_sin = rope_table(self.n_ctx, cfg.rot_dims, cfg.rope_theta, dev)
        self.gpu_first = [torch.arange(lw.ffn.n + len(lp.cpu_neurons), device=dev) < lw.ffn.n
                          for lw, lp in zip(self.layers, self.plan.layers)]
        self.all_rows = [torch.arange(lw.ffn.n, dtype=torch.int32, device=dev) for lw in self.layers]
        # the CPU shard's rows for dense prefill: set by attach_cold once the CPU executor exists
        self.cold: list[FFNShard] | None = None
        self.cold_source: str | None = None  # "shared" (the CPU executor's pages) | "copy" (our own)
        self._cold_pinned: int = 0  # address cudaHostRegister'ed (shared pages), for close()

    def fill_cold(self, spec: SharedShardSpec) -> None:
        """Generate the CPU executor's rows here (its file laid out with ``defer_fill``) and write
        them into its shared pages: a planted model's rows come many times faster from a GPU."""
        fill(spec, self.src, self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the layers' rows passed through: give their blocks back

    def attach_cold(self, spec: SharedShardSpec | None) -> str | None:
        """The CPU shard's rows for dense prefill of long prompts: the CPU executor's shared pages
        (``spec``; pinned for DMA on CUDA), else our own host copy when it takes at most a third of
        the host's available memory. Called by the engine after both executors exist; returns
        where the rows come from (None: dense prefill off)."""
        cfg = self.cfg
        if self.cold is not None or self.prefill_dense_min <= 0 or not any(len(lp.cpu_neurons) for lp in self.plan.layers):
            return self.cold_source
        mapped = attach(spec) if spec is not None else None
        if mapped is not None:
            self.cold, buf = mapped
            self.cold_source = "shared"
            if self.device.type == "cuda" and pin_host(buf.data_ptr(), buf.numel() * buf.element_size(),
                                                       "the shared CPU shard (dense prefill)"):
                self._cold_pinned = buf.data_ptr()
            return self.cold_source
        cold_bytes = sum(len(lp.cpu_neurons) for lp in self.plan.layers) * cfg.neuron_bytes
        avail = _host_available_bytes()
        if self._prefill_auto and avail is not None and cold_bytes > avail // 3:
            # a second host copy of the CPU shard would crowd the CPU executor's own
            log.warning("primary: dense prefill off: the CPU shard's %.1f GiB would take more than a third "
                        "of the host's %.1f GiB available", cold_bytes / 2**30, avail / 2**30)
            self.prefill_dense_min = 0
            return None
        self.cold = [self._host_shard(l) for l in range(cfg.n_layer)]
        self.cold_source = "copy"
        return self.cold_source

    def _host_shard(self, l: int) -> FFNShard:
        """The CPU executor's rows of layer l, in (pinned) host memory, for dense prefill."""
        sh = load_ffn_shard(self.src, l, self.plan[l].cpu_neurons, self.dtype, self.device)
        pin = self.device.type == "cuda"
        host = lambda t: None if t is None else (t.cpu().pin_memory() if pin else t)  # noqa: E731
        return FFNShard(sh.ids, host(sh.up), host(sh.gate), host(sh.down_t), host(sh.up_bias))

    def weight_bytes(self) -> int:
        """Bytes this executor holds (weights + KV cache), as counted against a VRAM budget."""
        ts = [self.embd, self.out_w if self.out_w is not self.embd else None, self.pos_embd]
        total = sum(t.numel() * t.element_size() for t in ts if t is not None)
        for lw in self.layers:
            total += lw.ffn.nbytes + lw.attn.weight_bytes + lw.attn.cache_bytes
            total += sum(t.numel() * t.element_size() for t in (lw.fc1, lw.fc2) if t is not None)
        return total

    def read_bytes_per_step(self) -> int:
        """Weight bytes every step reads besides the active FFN rows: attention of its heads,
        predictors, output head (the roofline numerator of the dense parts)."""
        total = self.out_w.numel() * self.out_w.element_size()
        for lw in self.layers:
            total += lw.attn.weight_bytes
            total += sum(t.numel() * t.element_size() for t in (lw.fc1, lw.fc2) if t is not None)
        return total

    # --- channel -----------------------------------------------------------------------------------
    def create_channel(self) -> ChannelSpec | None:
        """Create the shared-memory channel to the CPU executor (None: the plan needs no CPU)."""
        if not self.plan.needs_cpu_executor:
            return None
        x_dtype = {torch.float16: "f16", torch.bfloat16: "bf16"}.get(self.dtype, "f32")
        self.channel = Channel.create(self.cfg.n_embd, self.t_max, self.slots, self.plan.max_cpu_neurons, x_dtype)
        if self.device.type == "cuda":
            self.channel.pin_for_cuda()
        return self.channel.spec

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close(unlink=True)
            self.channel = None
        if self._cold_pinned:
            torch.cuda.cudart().cudaHostUnregister(self._cold_pinned)
            self._cold_pinned = 0

    # --- the step ----------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """The norm of the fp32 residual x [N, D], in the compute dtype (fused kernels on CUDA)."""
        if self.cfg.norm == "rms":
            y = Fn.rms_norm(x, (x.shape[-1],), pair[0], self.cfg.norm_eps) if x.is_cuda \
                else rms_norm(x, pair[0], self.cfg.norm_eps)
        else:
            y = layer_norm(x, pair[0], pair[1], self.cfg.norm_eps)
        return y.to(self.dtype)

    def _predict(self, lw: LayerWeights, pred_in: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Predicted activity of the primary's and the CPU's neurons: bool [N, n_gpu], [N, n_cpu]."""
        if self.policy != "predictor":
            return None, None
        active = predictor_logits(pred_in.to(self.dtype), lw.fc1, lw.fc2) >= self.threshold  # [N, n_gpu + n_cpu]
        ng = lw.ffn.n
        return active[:, :ng], (active[:, ng:] if active.shape[1] > ng else None)

    def _post(self, op: int, l: int, n_seq: int, x_attn: torch.Tensor | None, x_ffn: torch.Tensor | None,
              cpu_mask: torch.Tensor | None) -> tuple[int, int]:
        """Copy this layer's request into the channel and publish it; returns (seq, t_post_ns)."""
        ch, N = self.channel, (x_attn if x_attn is not None else x_ffn).shape[0]
        t0 = time.monotonic_ns()
        if x_attn is not None:
            ch.x_attn[:N].copy_(x_attn, non_blocking=True)
        if x_ffn is not None:
            ch.x_ffn[:N].copy_(x_ffn, non_blocking=True)
        n_mask = 0
        if cpu_mask is not None:
            n_mask = cpu_mask.shape[1]
            packed = pack_mask(cpu_mask)  # [N, ceil(n/8)]: an eighth of the bytes to copy
            torch.from_numpy(ch.mask_rows(N, n_mask)).copy_(packed, non_blocking=True)
        _sync(self.device)
        t1 = time.monotonic_ns()
        self.stats.sync_s += (t1 - t0) * 1e-9  # D2H
        return ch.post(op, l, n_seq, N, n_mask), t1

    def await_peer(self, seq: int, t_post: int) -> int:
        """Wait for the CPU executor's answer to request ``seq`` (posted at ``t_post``) and count
        the exchange: its compute, the sync (notify + return latency) and the host's wait.
        Returns when the answer was seen (``time.monotonic_ns``). Eager and graph steps share it."""
        t_start, t_end = self.channel.wait_response(seq, self.timeout_s, spin_s=0.05)
        t_seen = time.monotonic_ns()
        st = self.stats
        st.exchanges += 1
        st.peer_compute_s += (t_end - t_start) * 1e-9
        st.sync_s += ((t_start - t_post) + (t_seen - t_end)) * 1e-9
        st.layer_s["wait"] += (t_seen - t_post) * 1e-9
        return t_seen

    def _collect(self, seq: int, t_post: int, N: int) -> torch.Tensor:
        """Wait for the CPU executor's answer to ``seq``; its partial output [N, D] on our device."""
        t_seen = self.await_peer(seq, t_post)
        y = self.channel.out[:N].to(self.device, non_blocking=True)
        self.stats.sync_s += (time.monotonic_ns() - t_seen) * 1e-9  # the H2D copy's launch
        return y

    def _ffn(self, lw: LayerWeights, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        y, pairs, rows = ffn_partial(x, lw.ffn, self.cfg.ffn_act, self.policy, mask)
        self.stats.neurons += pairs
        self.stats.active_bytes += rows * self.cfg.neuron_bytes  # a row is read once per step
        return y

    def _cold_ffn(self, l: int, x: torch.Tensor, mask: torch.Tensor | None, rows: int = 4096) -> torch.Tensor:
        """The CPU shard's FFN output [N, D] computed densely here, its rows streamed from host
        memory in chunks of ``rows`` (the chunk is what this costs in device memory)."""
        cold, dev = self.cold[l], self.device
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=dev)
        for a in range(0, cold.n, rows):
            b = min(a + rows, cold.n)
            up = cold.up[a:b].to(dev, x.dtype, non_blocking=True)  # shared rows keep the CPU executor's dtype
            gate = cold.gate[a:b].to(dev, x.dtype, non_blocking=True) if cold.gate is not None else None
            u = x @ up.T  # [N, b-a]
            if cold.up_bias is not None:
                u = u + cold.up_bias[a:b].to(dev, u.dtype, non_blocking=True)  # fp32 bias: keep u's dtype
            hid = ffn_activation(self.cfg.ffn_act, u, x @ gate.T if gate is not None else None)
            if mask is not None:
                hid = hid * mask[:, a:b]
            y += (hid @ cold.down_t[a:b].to(dev, hid.dtype, non_blocking=True)).float()
        pairs = int(mask.sum()) if mask is not None else x.shape[0] * cold.n
        self.stats.cold_neurons += pairs
        self.stats.active_bytes += cold.n * self.cfg.neuron_bytes
        return y

    def _layer(self, l: int, h: torch.Tensor, slots: list[int], start: list[int], B: int) -> torch.Tensor:
        """One transformer block over h [N, D] (N = B*T tokens)."""
        cfg, lw, lp = self.cfg, self.layers[l], self.plan[l]
        N, D = h.shape
        cpu_heads, cpu_neurons = len(lp.cpu_groups) > 0, len(lp.cpu_neurons) > 0
        dense_cold = cpu_neurons and self.cold is not None and N >= self.prefill_dense_min
        cpu_neurons = cpu_neurons and not dense_cold  # the CPU executor's part of the FFN
        x_a = self._norm(h, lw.norm_attn)  # [N, D]
        attn = lambda: attn_partial(x_a.view(B, N // B, D), lw.attn, cfg, slots, start).view(N, D) \
            if lw.attn.n_groups else None  # noqa: E731
        t0 = time.perf_counter()
        if cfg.parallel_attn:
            x_f = self._norm(h, lw.norm_ffn) if lw.norm_ffn else x_a
            gmask, cmask = self._predict(lw, h)
            op = OP_ATTN_FFN if cpu_neurons else OP_ATTN
            pend = self._post(op, l, B, x_a if cpu_heads else None, x_f if cpu_neurons else None,
                              cmask if cpu_neurons else None) if cpu_heads or cpu_neurons else None
            a = attn()
            t1 = time.perf_counter()
            f = self._ffn(lw, x_f, gmask)
            cpu = self._collect(*pend, N) if pend else None
            if dense_cold:
                f = merge_partials([f, self._cold_ffn(l, x_f, cmask)])
            out = h + merge_partials([a, f, cpu], _add(lw.attn_out_bias, lw.down_bias)).to(h.dtype)
        else:
            pend = self._post(OP_ATTN, l, B, x_a, None, None) if cpu_heads else None
            a = attn()
            cpu_a = self._collect(*pend, N) if pend else None
            h = h + merge_partials([a, cpu_a], lw.attn_out_bias).to(h.dtype)
            t1 = time.perf_counter()
            x_f = self._norm(h, lw.norm_ffn)
            gmask, cmask = self._predict(lw, h)
            pend = self._post(OP_FFN, l, B, None, x_f, cmask) if cpu_neurons else None
            f = self._ffn(lw, x_f, gmask)
            cpu_f = self._collect(*pend, N) if pend else None
            if dense_cold:
                cpu_f = self._cold_ffn(l, x_f, cmask)
            out = h + merge_partials([f, cpu_f], lw.down_bias).to(h.dtype)
        self.stats.layer_s["attn"] += t1 - t0
        self.stats.layer_s["ffn"] += time.perf_counter() - t1
        return out

    @torch.no_grad()
    def step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int]) -> np.ndarray:
        """Run B sequences of T new tokens each (same T for all) from positions start_pos;
        returns the logits of each sequence's last token [B, V] (float32)."""
        B, T = len(tokens), len(tokens[0])
        assert all(len(t) == T for t in tokens), "a step runs sequences of equal token counts"
        if B * T > self.t_max and self.channel is not None:
            raise ValueError(f"step of {B}x{T} tokens exceeds the channel's {self.t_max}")
        end = max(start_pos) + T
        if end > self.n_ctx:
            raise ValueError(f"sequence reaches {end} tokens, beyond the context n_ctx={self.n_ctx}")
        t0 = time.perf_counter()
        if T == 1 and self.use_graphs:
            # batch sizes padded to powers of two (capped at the slots): few graph sets to capture
            bucket = min(1 << (B - 1).bit_length(), self.slots)
            g = self._graphs.get(bucket)
            if g is None:
                g = self._graphs[bucket] = DecodeGraphs(self, bucket)
            try:
                out = g.run(list(slots), [t[0] for t in tokens], list(start_pos))
                self._count_step(B, t0)
                return out
            except GraphCaptureError as e:  # before any exchange or replay: the eager step is safe
                log.warning("primary: decode graphs unavailable, running eager steps (%s)", e)
                self.use_graphs = False
                self._graphs.clear()
        dev = self.device
        tok = torch.tensor(tokens, dtype=torch.long, device=dev).reshape(-1)  # [N]
        start = list(start_pos)  # host lists: the attention kernel slices the cache without a sync
        if self.channel is not None:
            self.channel.slots[:B] = slots
            self.channel.start_pos[:B] = start_pos
        h = self.embd[tok].float()  # [N, D]: the residual stream stays fp32
        if self.pos_embd is not None:
            pos = torch.tensor([[s + t for t in range(T)] for s in start], device=dev).reshape(-1)  # [N]
            h = h + self.pos_embd[pos + self.cfg.pos_offset].float()
        for l in range(self.cfg.n_layer):
            h = self._layer(l, h, list(slots), start, B)
        last = h.view(B, T, -1)[:, -1]  # [B, D]
        logits = (self._norm(last, self.out_norm) @ self.out_w.T).float()  # [B, V]
        out = logits.cpu().numpy()
        self._count_step(B * T, t0)
        return out

    def _count_step(self, n_tok: int, t0: float) -> None:
        st = self.stats
        st.steps += 1
        st.tokens += n_tok
        st.busy_s += time.perf_counter() - t0


def _host_available_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else (a if b is None else a + b)


# ------------------------------------------------------------------------------------------------
class OneThread:
    """Runs callables one after another in a single daemon thread (``call`` waits for the result,
    ``submit`` returns a Future; exceptions travel with them). Not ThreadPoolExecutor(1): its
    worker is joined at interpreter exit, and the serving loop it would run ends only on OP_STOP.

    Why the CPU executor needs it: libgomp (the OpenMP runtime of torch and of the compiled
    kernel) keeps a pool of worker threads per thread that starts parallel regions. Loading in the
    actor's thread and serving in another gave the process two pools; once its OpenMP threads
    outnumber the cores libgomp stops spinning between regions, so every region and every barrier
    of the kernel wakes its workers from sleep. Dev machine, 2 threads: an empty region 0.3 ms
    after the last one took 3 us with one pool and 14 us with two (a script, not kept). GPU host:
    the 13B hybrid's CPU kernel took 280 us per exchange where the CPU executor had generated its
    rows itself (torch, in the actor's thread) and 128 us where the primary had written them
    (`runtime-13b-16gib-fill-h200.json`), and layer-offload's CPU attention twice its time alone
    (`cpu-attention-falcon-h200.json`). Measured on the host with this class since
    (`runtime-13b-16gib-h200-v8.json`, `runtime-falcon40b-24gib-h200-v5.json`): neither changed, so
    those two gaps have another cause; the one pool stays (it is what the dev machine shows is
    right). All of the CPU executor's torch and kernel work runs here."""

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
        """defer_fill: when the FFN rows go to a shared file, leave them for the primary to write
        (`PrimaryExecutor.fill_cold`, then `filled`): planted models, generated faster on a GPU."""
        self._omp = OneThread("cpu-executor")
        self._serving: Future | None = None
        try:
            self._omp.call(lambda: self._load(model, plan, policy, slots, n_ctx, threads, dtype, defer_fill))
        except BaseException:
            self._omp.close()
            raise

    def _load(self, model, plan, policy, slots, n_ctx, threads, dtype, defer_fill) -> None:  # noqa: ANN001
        self.src = open_model(model)
        self.cfg = cfg = self.src.config
        self.plan, self.policy = plan, policy
        # policy 'dense' reads every row in full, as a dense FFN (llama.cpp) does, down rows of zero
        # activations too: the layer-offload baseline. $POWERINFER_RAY_DENSE_SKIP=1 skips them (a
        # baseline stronger than llama.cpp, for comparison with the runs before this default).
        self.skip_zero = policy != "dense" or os.environ.get("POWERINFER_RAY_DENSE_SKIP", "0") == "1"
        self.threads = threads or torch.get_num_threads()
        torch.set_num_threads(self.threads)
        wdt = _DTYPES[dtype or cfg.dtype]
        n_ctx = min(n_ctx or cfg.n_ctx, cfg.n_ctx)
        dev = torch.device("cpu")
        # the FFN rows go into one shared-memory file when /dev/shm has room: the primary maps the
        # same pages for dense prefill instead of holding a second copy (runtime/sharedshard.py)
        load = lambda l: load_ffn_shard(self.src, l, plan[l].cpu_neurons, wdt, dev)  # noqa: E731
        shared = share([len(plan[l].cpu_neurons) for l in range(cfg.n_layer)], cfg.gated, cfg.n_embd, wdt, load,
                       defer=self._ids_and_bias if defer_fill else None)
        self.ffn, self.shard_spec = shared if shared is not None else ([load(l) for l in range(cfg.n_layer)], None)
        self.needs_fill = defer_fill and shared is not None
        # attention weights in the model's dtype, read in place by the compiled kernel's linear
        # (fp32 weights read twice the bytes; torch would widen them per call); KV cache in fp32
        self.attn = [load_attn_shard(self.src, l, plan[l].cpu_groups, wdt, dev, slots + 1, n_ctx,
                                     cache_dtype=torch.float32, out_rows=True) for l in range(cfg.n_layer)]
        self.stats = ExecStats()
        self.channel: Channel | None = None
        self.error: str | None = None

    def weight_bytes(self) -> int:
        return sum(s.nbytes for s in self.ffn) + sum(a.weight_bytes + a.cache_bytes for a in self.attn)

    def set_threads(self, n: int) -> int:
        """Threads of the next requests' kernels and torch ops (live: the serving loop applies it
        per request); for tuning against the other processes spinning on the host's cores."""
        if not isinstance(n, int) or not 1 <= n <= (os.cpu_count() or 1):
            raise ValueError(f"threads={n!r}: expected an int in [1, {os.cpu_count()}] (this host's cores)")
        self.threads = n
        if self._serving is None:
            self._omp.call(lambda: torch.set_num_threads(n))
        return n

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
            if not by_primary:
                fill(self.shard_spec, self.src, torch.device("cpu"))
            prefault(self.ffn)
        self._omp.call(run)
        self.needs_fill = False

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The attention projections: fp32 x, weights read in place by the kernel's threads."""
        return cpu_linear(x, w, b, self.threads)

    def attach(self, spec: ChannelSpec) -> int:
        self.channel = Channel.attach(spec)
        return os.getpid()

    def start(self) -> None:
        """Serve requests in the worker thread until OP_STOP (the actor stays responsive); every
        request posted after this call is served (the sequence number is read here, not when the
        worker gets to it)."""
        last = int(self.channel.header[0])
        self._serving = self._omp.submit(lambda: self.serve(last))
        self._serving.add_done_callback(_log_failure)

    def serve(self, last: int) -> None:
        ch = self.channel
        applied = torch.get_num_threads()
        while True:
            last = ch.wait_request(last, spin_s=0.02)  # hot while generating, asleep when idle
            t_start = time.monotonic_ns()
            if self.threads != applied:  # set_threads while serving
                torch.set_num_threads(self.threads)
                applied = self.threads
            op, l, n_seq, n_tok, n_mask = ch.request()
            if op == OP_STOP:
                ch.respond(last, t_start)
                return
            ok = True
            try:
                if op != OP_PING:
                    self._compute(op, l, n_seq, n_tok, n_mask)
            except Exception:  # report to the primary, keep serving  # noqa: BLE001
                log.exception("cpu executor: layer %d failed", l)
                self.error, ok = f"layer {l} failed", False
            ch.respond(last, t_start, ok)
            self.stats.busy_s += (time.monotonic_ns() - t_start) * 1e-9

    @torch.no_grad()
    def _compute(self, op: int, l: int, n_seq: int, n_tok: int, n_mask: int) -> None:
        ch, cfg = self.channel, self.cfg
        out = ch.out[:n_tok]  # [N, D] (x's dtype): the partial outputs are written (and summed) in place
        wrote = False
        if op in (OP_FFN, OP_ATTN_FFN) and self.ffn[l].n:
            sh = self.ffn[l]
            if self.policy == "oracle":  # finds its own active set: the general path
                y, pairs, rows = ffn_partial(ch.x_ffn[:n_tok].float(), sh, cfg.ffn_act, self.policy, None,
                                             threads=self.threads)
                out.copy_(y)
                nbytes = rows * cfg.neuron_bytes
            else:  # one compiled call from the channel's packed mask and x to out
                packed = ch.mask_rows(n_tok, n_mask) if self.policy == "predictor" else None
                t_k = time.monotonic_ns()
                pairs, rows, down_rows = sparse_ffn_bitmask(
                    ch.x_ffn[:n_tok], sh.up, sh.gate, sh.down_t, packed, n_mask if packed is not None else sh.n,
                    cfg.ffn_act, sh.up_bias, out, self.threads, skip_zero=self.skip_zero)
                self.stats.kernel_s += (time.monotonic_ns() - t_k) * 1e-9
                row_bytes = cfg.n_embd * cfg.dtype_bytes  # bytes read: the up (+ gate) rows, the down rows read
                nbytes = rows * (cfg.neuron_bytes - row_bytes) + down_rows * row_bytes
            self.stats.neurons += pairs
            self.stats.active_bytes += nbytes
            wrote = True
        if op in (OP_ATTN, OP_ATTN_FFN) and self.attn[l].n_groups:
            x = ch.x_attn[:n_tok].float().view(n_seq, n_tok // n_seq, cfg.n_embd)
            slots, start = ch.slots[:n_seq].tolist(), ch.start_pos[:n_seq].tolist()
            t_a = time.monotonic_ns()
            a = attn_partial(x, self.attn[l], cfg, slots, start, self._linear).view(n_tok, cfg.n_embd)
            self.stats.attn_s += (time.monotonic_ns() - t_a) * 1e-9
            out.add_(a) if wrote else out.copy_(a)
            self.stats.active_bytes += self.attn[l].weight_bytes  # read in full by every step
            wrote = True
        if not wrote:
            out.zero_()
        self.stats.exchanges += 1
        self.stats.tokens += n_tok if l == 0 else 0

    def stop(self) -> None:
        if self._serving is not None:
            futures_wait([self._serving], timeout=5)
        self._omp.close()
        release(self.shard_spec)  # our handle on the shared rows (their pages stay while mapped)
