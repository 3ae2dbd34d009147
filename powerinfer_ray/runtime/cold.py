"""Dense prefill of the CPU shard: for long prompts the primary computes the CPU executor's
neurons itself, densely, streaming their rows to its device once per chunk (upstream PowerInfer's
dense prefill). A GPU does a chunk of tokens over all of those rows faster than the CPU kernel
does the few active ones per token, and the exchange with the CPU executor drops out.

Where the rows come from, without a second host copy where possible:
  file    the model file's own memory map (``shard.in_place_ffn_shard``): whole row ranges of
          ffn_up / ffn_gate / ffn_down_t stream to the device and the rows of the primary's own
          neurons are masked out there (contiguous copies, no gather on the host). On CUDA the
          ranges of a file on tmpfs are page-locked (read-only cudaHostRegister) layer by layer
          at their first use, so the copies are DMA; a file on disk is copied from pageable
          pages (locking them would pin its page cache);
  shared  the CPU executor's shared-memory copy (``sharedshard``: sources without a file),
          pinned here for DMA;
  copy    a host copy of the primary's own, when it fits.
Quantized rows stream as their blocks and go through the quantized sparse FFN kernel.

Zero-copy decode (``host_rows``): in decode steps the primary also computes a share of the CPU
shard's active neurons itself, its GPU reading their rows over PCIe where they lie in page-locked
host memory, while the CPU executor computes the rest (their bits stay clear in its mask). Both
read host memory at once: the host serves more than the CPU's cores take alone.

Dimension legend: N tokens, D hidden, R rows of the streamed matrices, n the shard's neurons.
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.sparse_ffn import sparse_ffn
from ..kernels.torch_ffn import apply_act_threshold
from ..model.reference import ffn_activation
from ..model.source import WeightSource, file_mapping
from .channel import device_view, pin_host
from .hostmem import host_memory, on_tmpfs
from .layers import oracle_mask, shard_activation
from .plan import Plan, Swap
from .shard import FFNShard, in_place_ffn_shard, load_ffn_shard, replace_neurons
from .sharedshard import SharedShardSpec, attach
from .stats import ExecStats

log = logging.getLogger(__name__)


def pin_mapped(views: list[torch.Tensor], what: str, pinned: list[int]) -> bool:
    """Page-lock (read-only cudaHostRegister) the pages of these views of a file's mapping, merged
    into runs (neighbouring tensors share pages; a page cannot be registered twice); the addresses
    registered go to ``pinned`` (for cudaHostUnregister). False when one failed."""
    page = mmap.PAGESIZE
    spans = sorted((t.data_ptr() // page * page, -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page)
                   for t in views)
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    for a, b in merged:
        if not pin_host(a, b - a, what, read_only=True):
            return False
        pinned.append(a)
    return True


# zero-copy's default on CUDA: this share of the CPU shard's neurons in decode steps of at least
# ZERO_COPY_MIN_BATCH sequences (bench/RESULTS.md, zero-copy: at batch 1 the CPU kernel's time is
# mostly its fixed cost, which fewer rows do not shorten, while the GPU's PCIe reads delay its next
# segment)
ZERO_COPY = 0.35
ZERO_COPY_MIN_BATCH = 8


@dataclass
class HostRows:
    """What the primary computes of layer l's CPU shard in decode steps (``ColdRows.host_rows``)."""

    shard: FFNShard  # up / gate / down_t as the primary's device reads them in place; up_bias on it
    local: torch.Tensor  # [n_cpu] int32: each CPU neuron's row in them (the CPU mask's order)
    mine: torch.Tensor  # [n_cpu] bool: the neurons the primary computes; the CPU executor the others
    n: int  # how many are mine


def interleaved(n: int, share: float) -> np.ndarray:
    """bool [n]: a ``share`` of the neurons, spread evenly over the shard's order (hottest first
    when the plan knows the statistics, so both sides get a like share of the activity)."""
    j = np.arange(n)
    return np.floor((j + 1) * share) > np.floor(j * share)


class ColdRows:
    """The CPU shard's rows as the primary sees them, for prompts of at least ``min_tokens``
    tokens (None: 32 on CUDA, off on the CPU; 0: off), and the ``zero_copy`` share of the CPU's
    active neurons that the primary computes in decode steps (``host_rows``; None: ZERO_COPY in
    steps of at least ZERO_COPY_MIN_BATCH sequences on CUDA, none on the CPU; 0: none)."""

    def __init__(self, src: WeightSource, plan: Plan, dtype: torch.dtype, device: torch.device,
                 stats: ExecStats, min_tokens: int | None, zero_copy: float | None = 0.0) -> None:
        self.src, self.cfg, self.plan, self.dtype, self.device, self.stats = src, src.config, plan, dtype, device, stats
        self._auto = min_tokens is None
        self.min_tokens = (32 if device.type == "cuda" else 0) if min_tokens is None else min_tokens
        self.zero_copy = 0.0 if zero_copy is None and device.type != "cuda" else zero_copy
        self._host: dict[tuple[int, float], HostRows | None] = {}
        self._shared_pinned = False
        self._said_no_host = False
        self.rows: list[FFNShard] | None = None  # per layer, once attached
        self.source: str | None = None  # file | shared | copy
        self._pinned: list[int] = []  # addresses cudaHostRegister'ed, for close()
        self._pin_file = False  # page-lock the file's ranges at their first use
        self._layer_pinned: set[int] = set()
        self._sel: dict[int, torch.Tensor] = {}  # in place: the shard's rows [n] on the device, per layer

    def attach(self, spec: SharedShardSpec | None) -> str | None:
        """Read the rows in place from the model file, else map the CPU executor's shared pages
        (``spec``), else make a host copy when it takes at most a third of the host's available
        memory; returns where the rows come from (None: dense prefill off)."""
        wanted = self.min_tokens > 0 or self.zero_copy != 0
        if self.rows is not None or not wanted or not any(len(lp.cpu_neurons) for lp in self.plan.layers):
            return self.source
        in_place = [in_place_ffn_shard(self.src, l, lp.cpu_neurons, None) for l, lp in enumerate(self.plan.layers)]
        if all(sh is not None for sh in in_place):
            self.rows, self.source = in_place, "file"
            self._pin_file = self.device.type == "cuda" and on_tmpfs(file_mapping(self.src).path)
            return self.source
        mapped = attach(spec) if spec is not None else None
        if mapped is not None:
            self.rows, buf = mapped
            self.source = "shared"
            if self.device.type == "cuda" and pin_host(buf.data_ptr(), buf.numel() * buf.element_size(),
                                                       "the shared CPU shard (dense prefill, zero-copy)"):
                self._pinned.append(buf.data_ptr())
                self._shared_pinned = True
            return self.source
        cold_bytes = sum(len(lp.cpu_neurons) for lp in self.plan.layers) * self.cfg.neuron_bytes
        avail = host_memory().available
        if self._auto and cold_bytes > avail // 3:
            # a second host copy of the CPU shard would crowd the CPU executor's own
            log.warning("primary: dense prefill off: the CPU shard's %.1f GiB would take more than a third "
                        "of the host's %.1f GiB available", cold_bytes / 2**30, avail / 2**30)
            self.min_tokens, self.zero_copy = 0, 0.0
            return None
        self.rows = [self._host_shard(l) for l in range(self.cfg.n_layer)]
        self.source = "copy"
        return self.source

    def _host_shard(self, l: int) -> FFNShard:
        """The CPU executor's rows of layer l, in (pinned) host memory."""
        sh = load_ffn_shard(self.src, l, self.plan[l].cpu_neurons, self.dtype, self.device)
        pin = self.device.type == "cuda"
        host = lambda t: None if t is None else (t.cpu().pin_memory() if pin else t)  # noqa: E731
        return FFNShard(sh.ids, host(sh.up), host(sh.gate), host(sh.down_t), host(sh.up_bias), sh.qtype)

    def dense_for(self, n_tok: int) -> bool:
        """Whether a step of n_tok tokens computes the CPU shard here."""
        return self.rows is not None and 0 < self.min_tokens <= n_tok

    def share(self, batch: int) -> float:
        """The zero-copy share of decode steps of ``batch`` sequences (see the class)."""
        if self.zero_copy is not None:
            return self.zero_copy
        return ZERO_COPY if batch >= ZERO_COPY_MIN_BATCH else 0.0

    def host_rows(self, l: int, share: float) -> HostRows | None:
        """The ``share`` of layer l's CPU shard that the primary computes in decode steps, reading
        the rows in place (on CUDA: page-locked, zero-copy); None: a share of none, or these rows
        cannot be read so (a file on disk, whose page cache is not locked; float rows of another
        dtype than the primary computes in; pinning refused)."""
        if (l, share) in self._host:
            return self._host[l, share]
        hr = None
        cold = self.rows[l] if self.rows is not None and share > 0 else None
        k = 0 if cold is None else int(interleaved(cold.n, share).sum())
        if k and (cold.qtype is not None or cold.up.dtype == self.dtype) and self._lockable(l):
            mats = [None if t is None else (device_view(t) if self.device.type == "cuda" else t)
                    for t in (cold.up, cold.gate, cold.down_t)]
            bias = None if cold.up_bias is None else cold.up_bias.to(self.device, torch.float32)
            local = cold.rows if cold.rows is not None else torch.arange(cold.n, dtype=torch.int32)
            mine = torch.from_numpy(interleaved(cold.n, share))
            hr = HostRows(FFNShard(cold.ids, *mats, bias, cold.qtype), local.to(self.device, torch.int32),
                          mine.to(self.device), k)
        elif k and not self._said_no_host:
            self._said_no_host = True
            log.warning("primary: zero-copy off: the CPU shard's rows (%s) cannot be read in place by %s (a file "
                        "outside tmpfs is not page-locked; float rows must be the compute dtype %s)", self.source,
                        self.device, self.dtype)
        self._host[l, share] = hr
        return hr

    def swap(self, s: Swap) -> None:
        """Re-placement: the neurons ``s.to_cpu`` take the CPU shard's rows ``s.cpu_rows``. In the
        file's map and in a copy of our own the rows change here (ids; rows copied in); in the CPU
        executor's shared pages it writes them (``CPUExecutor.swap``), and only the ids change here."""
        self.plan = self.plan.swap(s)
        if self.rows is None:
            return
        cold = self.rows[s.l]
        if self.source == "shared":
            cold.ids = cold.ids.copy()
            cold.ids[s.cpu_rows] = s.to_cpu
            return
        replace_neurons(self.src, s.l, cold, s.cpu_rows, s.to_cpu)
        if cold.rows is None:
            return
        new = torch.from_numpy(s.to_cpu.astype(np.int32))
        at = torch.from_numpy(s.cpu_rows)
        if s.l in self._sel:
            self._sel[s.l][at.to(self.device)] = new.to(self.device, torch.long)
        for (l, _), hr in self._host.items():  # the decode graphs read these in place
            if l == s.l and hr is not None and hr.local.data_ptr() != cold.rows.data_ptr():
                hr.local[at.to(self.device)] = new.to(self.device)

    def _lockable(self, l: int) -> bool:
        """Whether layer l's rows are page-locked for the device to read (CPU primary: always)."""
        if self.device.type != "cuda":
            return True
        if self.source == "file":
            if self._pin_file and l not in self._layer_pinned:
                self._pin_layer(l)
            return self._pin_file
        return self.source == "copy" or self._shared_pinned

    def ffn(self, l: int, x: torch.Tensor, mask: torch.Tensor | None, act_threshold: float | None = None,
            act_on: str = "gate", rows: int = 4096, count: torch.Tensor | None = None,
            h_out: torch.Tensor | None = None) -> torch.Tensor:
        """The CPU shard's FFN output [N, D] (fp32) for x [N, D], masked by the predictor's
        mask [N, n] when given and by a sparsified SwiGLU model's activation threshold; rows stream
        in chunks of ``rows`` (its device memory cost). count [n] int64 (shard order): adds the
        tokens in which each neuron's h is nonzero (policy 'oracle', ``activity``). h_out [N, n]
        fp32 (shard order): receives the neurons' activations h (predictor samples, ``eager``)."""
        cold, dev = self.rows[l], self.device
        keep = self._keep(l, mask, x.shape[0])  # [N, R] or None (every row)
        hits = None if count is None else torch.zeros(cold.up.shape[0], dtype=torch.int64, device=dev)  # [R]
        h_rows = None if h_out is None else torch.zeros(x.shape[0], cold.up.shape[0], device=dev)  # [N, R]
        if self._pin_file and l not in self._layer_pinned:
            self._pin_layer(l)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=dev)
        streamed = 0
        for a, b in self._chunks(l, rows):
            streamed += b - a
            if cold.qtype is not None:
                k = None if keep is None else keep[:, a:b]
                y += self._quantized(cold, a, b, x, k, act_threshold, act_on)
                if hits is not None:
                    hits[a:b] += self._active(cold, a, b, x, k, act_threshold, act_on).sum(0)
                if h_rows is not None:  # the kernel keeps h inside: computed again from the blocks
                    h = shard_activation(x, self._chunk(cold, a, b), self.cfg.ffn_act, act_threshold, act_on)
                    h_rows[:, a:b] = h if k is None else h * k
                continue
            up = cold.up[a:b].to(dev, x.dtype, non_blocking=True)  # file / shared rows keep their dtype
            gate = cold.gate[a:b].to(dev, x.dtype, non_blocking=True) if cold.gate is not None else None
            u = x @ up.T  # [N, b-a]
            if cold.up_bias is not None:
                u = u + cold.up_bias[a:b].to(dev, u.dtype, non_blocking=True)  # fp32 bias: keep u's dtype
            g = x @ gate.T if gate is not None else None
            hid = ffn_activation(self.cfg.ffn_act, u, g)
            if act_threshold is not None:
                hid = apply_act_threshold(hid, g.float(), act_threshold, act_on)  # the criterion in fp32
            if keep is not None:
                hid = hid * keep[:, a:b]
            if hits is not None:
                hits[a:b] += (hid != 0).sum(0)
            if h_rows is not None:
                h_rows[:, a:b] = hid
            y += (hid @ cold.down_t[a:b].to(dev, hid.dtype, non_blocking=True)).float()
        if count is not None:
            count += hits if cold.rows is None else hits[self._sel[l]]
        if h_out is not None:
            h_out.copy_(h_rows if cold.rows is None else h_rows[:, self._sel[l]])
        self.stats.cold_neurons += int(mask.sum()) if mask is not None else x.shape[0] * cold.n
        self.stats.active_bytes += streamed * self.cfg.neuron_bytes
        return y

    def _keep(self, l: int, mask: torch.Tensor | None, n_tok: int) -> torch.Tensor | None:
        """Which streamed rows each token keeps [N, R] (bool): the mask's neurons at their rows;
        in place also none of the rows that are not the CPU's. None: every row."""
        cold = self.rows[l]
        if cold.rows is None:
            return mask
        sel = self._sel.get(l)
        if sel is None:
            sel = self._sel[l] = cold.rows.to(self.device).long()
        keep = torch.zeros(n_tok, cold.up.shape[0], dtype=torch.bool, device=self.device)
        keep[:, sel] = True if mask is None else mask
        return keep

    def _chunks(self, l: int, rows: int) -> list[tuple[int, int]]:
        """[a, b) row ranges to stream: every row of a copy; in place the chunks holding any of
        the CPU's rows."""
        cold = self.rows[l]
        R = cold.up.shape[0]
        chunks = [(a, min(a + rows, R)) for a in range(0, R, rows)]
        if cold.rows is None:
            return chunks
        used = np.bincount(cold.rows.numpy() // rows, minlength=len(chunks)) > 0
        return [c for c, u in zip(chunks, used) if u]

    def _pin_layer(self, l: int) -> None:
        """Page-lock layer l's matrices in the file's mapping (read-only)."""
        self._layer_pinned.add(l)
        cold = self.rows[l]
        if not pin_mapped([t for t in (cold.up, cold.gate, cold.down_t) if t is not None],
                          f"layer {l}'s FFN rows in the model file (dense prefill)", self._pinned):
            self._pin_file = False  # said once; the rest copy from pageable pages

    def _quantized(self, cold: FFNShard, a: int, b: int, x: torch.Tensor, mask: torch.Tensor | None,
                   act_threshold: float | None = None, act_on: str = "gate") -> torch.Tensor:
        """Rows a..b of a quantized shard [N, D] (fp32): their blocks streamed to the device and
        computed by the quantized sparse FFN kernel over every row (masked: the predictor's; and
        by a SwiGLU activation threshold)."""
        dev = self.device
        blocks = [None if t is None else t[a:b].to(dev, non_blocking=True) for t in (cold.up, cold.gate, cold.down_t)]
        bias = None if cold.up_bias is None else cold.up_bias[a:b].to(dev, non_blocking=True)
        idx = torch.arange(b - a, device=dev)
        return sparse_ffn(x, *blocks, idx, mask, self.cfg.ffn_act, bias, qtype=cold.qtype, act_threshold=act_threshold,
                          act_on=act_on).float()

    def _active(self, cold: FFNShard, a: int, b: int, x: torch.Tensor, keep: torch.Tensor | None,
                act_threshold: float | None, act_on: str) -> torch.Tensor:
        """Which of the quantized rows a..b are active for each token [N, b-a] (``oracle_mask``
        over their blocks on the device), within ``keep``."""
        m = oracle_mask(x, self._chunk(cold, a, b), self.cfg.ffn_act, act_threshold, act_on)
        return m if keep is None else m & keep

    def _chunk(self, cold: FFNShard, a: int, b: int) -> FFNShard:
        """Rows a..b of up / gate (and the bias) on the device, for ``oracle_mask`` and
        ``shard_activation`` (which read only those; its down rows unused)."""
        up, gate = (None if t is None else t[a:b].to(self.device, non_blocking=True) for t in (cold.up, cold.gate))
        bias = None if cold.up_bias is None else cold.up_bias[a:b].to(self.device, non_blocking=True)
        return FFNShard(cold.ids[:0], up, gate, up, bias, cold.qtype)

    def close(self) -> None:
        for addr in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(addr)
        self._pinned.clear()
