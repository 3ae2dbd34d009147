"""The CPU shard's rows as the primary sees them: in prompt chunks it computes a share of them
itself, densely, streaming their rows to its device once per chunk (upstream PowerInfer's dense
prefill); in decode steps it computes a share of their active neurons from host memory
(zero-copy). A GPU does a chunk of tokens over rows faster than the CPU kernel does the few active
ones per token, once the chunk is long enough to pay for the rows' trip over PCIe.

Prefill (``ffn``): the streamed share is the hottest rows of the shard (the plan orders it hottest
first): the CPU executor computes the chunk's predicted-active neurons among the rest (its mask
has the streamed rows' bits clear), where fewer tokens hit a row. Chunks of at least
``min_tokens`` tokens stream every row (the exchange's FFN drops out); shorter ones of at least
PREFILL_SHARE_MIN tokens the ``prefill_share``, and the CPU executor alone computes the shortest
(``share_for``): its time grows with the tokens, a stream's does not. The rows reach the device
through two device buffers that take turns (``RowStream``): a copy stream fills one with the next
chunk of rows (the next layer's included) while the other's rows are computed on, so the copies
run beside the step's compute.
Where the rows come from, without a second host copy where possible:
  file    the model file's own memory map (``shard.in_place_ffn_shard``): on CUDA the layers'
          ranges of a file on tmpfs are page-locked at attach (read-only cudaHostRegister) and the
          GPU gathers the shard's rows from them itself (an index_select over the pages' device
          address, reading over PCIe); a file on disk is gathered on the host from pageable pages
          (locking them would pin its page cache);
  shared  the CPU executor's shared-memory copy (``sharedshard``: sources without a file), in
          shard order, pinned here: contiguous copies;
  copy    a host copy of the primary's own, when it fits, pinned.
Quantized rows stream as their blocks, dequantized by the sparse FFN kernels.

Zero-copy decode (``host_rows``): in decode steps the primary also computes a share of the CPU
shard's active neurons itself, its GPU reading their rows over PCIe where they lie in page-locked
host memory, while the CPU executor computes the rest (their bits stay clear in its mask). Both
read host memory at once: the host serves more than the CPU's cores take alone.

Dimension legend: N tokens, D hidden, R rows of a streamed chunk, n the shard's neurons.
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.sparse_ffn import sparse_ffn, takes_gemm
from ..kernels.torch_ffn import sparse_ffn_gemm
from ..model.source import WeightSource, file_mapping
from .channel import device_view, pin_host
from .hostmem import host_memory, on_tmpfs
from .layers import shard_activation
from .plan import Plan, Swap
from .shard import FFNShard, ffn_qtype, in_place_ffn_shard, load_ffn_shard, replace_neurons
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


STREAM_BYTES = 64 << 20  # each of the two device buffers the streamed rows of prefill take turns in
PREFILL_DENSE_MIN = 256  # prompt chunks of at least this many tokens stream every row of the CPU shard (CUDA)
# shorter chunks of at least PREFILL_SHARE_MIN tokens stream this share, its hottest rows, and the
# shortest none (CUDA; bench/RESULTS.md, prefill shares: 13B at 16 GiB, 16 tokens 2-3x faster with
# none than with 0.5; 64 and 128 tokens 1.2-1.6x faster with 0.3 on one H100 host, within the
# spread on another)
PREFILL_SHARE = 0.3
PREFILL_SHARE_MIN = 64
# zero-copy's default on CUDA: this share of the CPU shard's neurons in decode steps of at least
# ZERO_COPY_MIN_BATCH sequences (bench/RESULTS.md, zero-copy: at batch 1 the CPU kernel's time is
# mostly its fixed cost, which fewer rows do not shorten, while the GPU's PCIe reads delay its next
# segment), and ZERO_COPY_Q4_0 in one-sequence steps when the rows are Q4_0 (the fused kernel reads
# their blocks over PCIe at ~45 GB/s: the 13B Q4_0 at 4 GiB, bench/RESULTS.md, the fused decode kernel).
# A default share is a candidate: the decode steps are captured without it too, and the faster set runs
# (``shares``; on another H100 host the same Q4_0 engine ran 25 % slower with it than without).
ZERO_COPY = 0.35
ZERO_COPY_MIN_BATCH = 8
ZERO_COPY_Q4_0 = 0.5


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
    """The CPU shard's rows as the primary sees them (see the module docstring): prompt chunks of at
    least ``min_tokens`` tokens (None: 256 on CUDA, off on the CPU; 0: never) stream all of them,
    shorter chunks the ``prefill_share`` hottest (None: PREFILL_SHARE on CUDA in chunks of at least
    PREFILL_SHARE_MIN tokens, none on the CPU; 0: none; a share given applies to every shorter
    chunk); in decode steps the ``zero_copy`` share of the CPU's active neurons (``host_rows``;
    None: on CUDA ZERO_COPY in steps of at least ZERO_COPY_MIN_BATCH sequences, ZERO_COPY_Q4_0 in
    steps of one on Q4_0 rows, else none; none on the CPU; 0: none). ``masked``: the CPU executor
    takes the predictor's mask (policy 'predictor'), so a share of its rows can be split off;
    without one a chunk streams all rows or none."""

    def __init__(self, src: WeightSource, plan: Plan, dtype: torch.dtype, device: torch.device,
                 stats: ExecStats, min_tokens: int | None, zero_copy: float | None = 0.0,
                 prefill_share: float | None = None, masked: bool = True) -> None:
        self.src, self.cfg, self.plan, self.dtype, self.device, self.stats = src, src.config, plan, dtype, device, stats
        cuda = device.type == "cuda"
        self._auto = min_tokens is None
        self.min_tokens = (PREFILL_DENSE_MIN if cuda else 0) if min_tokens is None else min_tokens
        share = (PREFILL_SHARE if cuda else 0.0) if prefill_share is None else prefill_share
        self.prefill_share = share if masked else 0.0
        self.share_min = PREFILL_SHARE_MIN if prefill_share is None else 1  # fewer tokens: the CPU executor's
        self.zero_copy = 0.0 if zero_copy is None and not cuda else zero_copy
        # (a CPU shard's layers share one storage, the CPU executor's check; without one none is asked)
        self.q4_0 = (self.zero_copy is None and any(len(lp.cpu_neurons) for lp in plan.layers)
                     and ffn_qtype(src) == "q4_0")
        self._host: dict[tuple[int, float], HostRows | None] = {}
        self._shared_pinned = False
        self._said_no_host = False
        self.rows: list[FFNShard] | None = None  # per layer, once attached
        self.source: str | None = None  # file | shared | copy
        self._pinned: list[int] = []  # addresses cudaHostRegister'ed, for close()
        self._pin_file = False  # the file's FFN matrices are page-locked (at attach)
        self.stream: RowStream | None = None  # the streamed rows' buffers, from the first prefill chunk
        self.k: list[int] = []  # this step's streamed rows per layer (``begin``)

    def attach(self, spec: SharedShardSpec | None) -> str | None:
        """Read the rows in place from the model file, else map the CPU executor's shared pages
        (``spec``), else make a host copy when it takes at most a third of the host's available
        memory; returns where the rows come from (None: no prefill share, no zero-copy)."""
        wanted = self.min_tokens > 0 or self.prefill_share > 0 or self.zero_copy != 0
        if self.rows is not None or not wanted or not any(len(lp.cpu_neurons) for lp in self.plan.layers):
            return self.source
        in_place = [in_place_ffn_shard(self.src, l, lp.cpu_neurons, None) for l, lp in enumerate(self.plan.layers)]
        if all(sh is not None for sh in in_place):
            self.rows, self.source = in_place, "file"
            if self.device.type == "cuda" and on_tmpfs(file_mapping(self.src).path):  # here, not in a request
                self._pin_file = pin_mapped([t for sh in self.rows for t in _mats(sh)],
                                            "the CPU shard's FFN rows in the model file", self._pinned)
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
            self.min_tokens, self.prefill_share, self.zero_copy = 0, 0.0, 0.0
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

    def share_for(self, n_tok: int, decode: bool = False) -> float:
        """The share of the CPU shard's rows a step of n_tok tokens streams and computes here (a
        decode step: none, zero-copy is the decode steps' share)."""
        if self.rows is None or decode:
            return 0.0
        if 0 < self.min_tokens <= n_tok:
            return 1.0
        return self.prefill_share if n_tok >= self.share_min else 0.0

    def begin(self, share: float) -> None:
        """A step that streams ``share`` of every layer's rows (``streamed_rows``) begins: the
        first chunks' copies start at once (``RowStream``)."""
        self.k = [streamed_rows(sh.n, share) for sh in self.rows] if self.rows is not None else []
        if not any(self.k):
            return
        if self.stream is None:
            self.stream = RowStream(self)
        self.stream.start([(l, a, min(a + self.stream.rows, k)) for l, k in enumerate(self.k)
                           for a in range(0, k, self.stream.rows)])

    def share(self, batch: int) -> float:
        """The zero-copy share of decode steps of ``batch`` sequences (see the class)."""
        if self.zero_copy is not None:
            return self.zero_copy
        if batch == 1 and self.q4_0:
            return ZERO_COPY_Q4_0
        return ZERO_COPY if batch >= ZERO_COPY_MIN_BATCH else 0.0

    def shares(self, batch: int) -> list[float]:
        """The zero-copy shares to capture the decode steps of ``batch`` sequences at: the one given;
        else the default (``share``) and none beside it, where the rows can be read in place (the
        primary runs the faster set, ``graphs.ShareChoice``)."""
        s = self.share(batch)
        if self.zero_copy is None and s > 0 and any(self.host_rows(l, s) for l, lp in enumerate(self.plan.layers)
                                                    if len(lp.cpu_neurons)):
            return [s, 0.0]
        return [s]

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
        if k and (cold.qtype is not None or cold.up.dtype == self.dtype) and self._lockable():
            mats = [None if t is None else (device_view(t) if self.device.type == "cuda" else t)
                    for t in (cold.up, cold.gate, cold.down_t)]
            bias = None if cold.up_bias is None else cold.up_bias.to(self.device, torch.float32)
            local = cold.rows if cold.rows is not None else torch.arange(cold.n, dtype=torch.int32)
            mine = torch.from_numpy(interleaved(cold.n, share))
            hr = HostRows(FFNShard(cold.ids, *mats, bias, cold.qtype), local.to(self.device, torch.int32),
                          mine.to(self.device), k)
        elif k and not self._said_no_host:
            self._said_no_host = True
            # a warning where zero_copy was asked for; its default only notes it
            log.log(logging.INFO if self.zero_copy is None else logging.WARNING,
                    "primary: zero-copy off: the CPU shard's rows (%s) cannot be read in place by %s (a file "
                    "outside tmpfs is not page-locked; float rows must be the compute dtype %s)", self.source,
                    self.device, self.dtype)
        self._host[l, share] = hr
        return hr

    def swap(self, s: Swap) -> None:
        """Re-placement: the neurons ``s.to_cpu`` take the CPU shard's rows ``s.cpu_rows``. In the
        file's map and in a copy of our own the rows change here (ids; rows copied in); in the CPU
        executor's shared pages it writes them (``CPUExecutor.swap``), and only the ids change here.
        The streamed rows' indices and bias on the device change in place."""
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
        if self.stream is not None:
            self.stream.swapped(s.l, at, new)
        for (l, _), hr in self._host.items():  # the decode graphs read these in place
            if l == s.l and hr is not None and hr.local.data_ptr() != cold.rows.data_ptr():
                hr.local[at.to(self.device)] = new.to(self.device)

    def _lockable(self) -> bool:
        """Whether the rows are page-locked for the device to read (CPU primary: always)."""
        if self.device.type != "cuda":
            return True
        if self.source == "file":
            return self._pin_file
        return self.source == "copy" or self._shared_pinned

    def ffn(self, l: int, x: torch.Tensor, mask: torch.Tensor | None, act_threshold: float | None = None,
            act_on: str = "gate", count: torch.Tensor | None = None,
            h_out: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN output [N, D] (fp32) of the step's streamed rows of layer l (its first ``k[l]``,
        ``begin``) for x [N, D], masked by the predictor's mask [N, k[l]] when given and by a
        sparsified SwiGLU model's activation threshold. count [k[l]] int64 (shard order): adds the
        tokens in which each neuron's h is nonzero (policy 'oracle', ``activity``). h_out
        [N, k[l]] fp32 (shard order): receives the neurons' activations h (predictor samples,
        ``eager``)."""
        cold, k, dev = self.rows[l], self.k[l], self.device
        # counted first: the mask is long computed, where after the loop the count would wait for its products
        self.stats.cold_neurons += int(mask.sum()) if mask is not None else x.shape[0] * k
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=dev)  # [N, D]
        for _ in range(-(-k // self.stream.rows)):
            a, b, (up, gate, down_t) = self.stream.take(l)
            bias = self._bias(l, a, b)
            y += self._chunk(x, FFNShard(cold.ids[:0], up, gate, down_t, bias, cold.qtype),
                             None if mask is None else mask[:, a:b], act_threshold, act_on,
                             None if count is None else count[a:b], None if h_out is None else h_out[:, a:b])
            self.stream.done()
        self.stats.active_bytes += k * self.cfg.neuron_bytes
        self.stats.streamed_bytes += k * self.cfg.neuron_bytes
        return y

    def _chunk(self, x: torch.Tensor, rows: FFNShard, mask: torch.Tensor | None, act_threshold: float | None,
               act_on: str, count: torch.Tensor | None, h_out: torch.Tensor | None) -> torch.Tensor:
        """The FFN output [N, D] (fp32) of a chunk of streamed rows (all of ``rows``): matrix
        products, counting as they go, for float rows and a GPU's chunk of many tokens; else the
        sparse FFN kernels (a CPU primary's multiplies quantized rows as ggml does). mask [N, R],
        count [R] and h_out [N, R] as ``ffn``'s."""
        act = self.cfg.ffn_act
        if rows.qtype is None or takes_gemm(x):
            y = sparse_ffn_gemm(x, rows.up, rows.gate, rows.down_t, None, mask, act, rows.up_bias, None, rows.qtype,
                                act_threshold, act_on, count=count if h_out is None else None).float()
            if h_out is None:
                return y
        else:
            y = sparse_ffn(x, rows.up, rows.gate, rows.down_t, torch.arange(rows.up.shape[0], device=x.device), mask,
                           act, rows.up_bias, qtype=rows.qtype, act_threshold=act_threshold, act_on=act_on).float()
        if count is not None or h_out is not None:  # the kernel keeps h inside: computed again
            h = shard_activation(x, rows, act, act_threshold, act_on)  # [N, R]
            h = h if mask is None else h * mask
            if count is not None:
                count += (h != 0).sum(0)
            if h_out is not None:
                h_out.copy_(h)
        return y

    def _bias(self, l: int, a: int, b: int) -> torch.Tensor | None:
        """The up bias of layer l's shard rows a..b [b - a] (fp32) on the device: a slice of a copy
        or of the shared rows (which re-placement rewrites), or of the in-place shard's bias
        gathered from the file once (``RowStream.swapped`` keeps it)."""
        cold = self.rows[l]
        if cold.up_bias is None:
            return None
        if cold.rows is None:
            return cold.up_bias[a:b].to(self.device, torch.float32, non_blocking=True)
        if l not in self.stream.bias:
            self.stream.bias[l] = cold.up_bias[cold.rows.long()].to(self.device, torch.float32)
        return self.stream.bias[l][a:b]

    def fill(self, bufs: list[torch.Tensor], l: int, a: int, b: int) -> None:
        """Rows a..b of layer l's shard (shard order) into the buffers' first b - a rows (up, gate
        if any, down_t): see the module docstring for how each source gets there."""
        cold = self.rows[l]
        for dst, src in zip(bufs, _mats(cold)):
            out = dst[:b - a]
            if cold.rows is None:
                out.copy_(src[a:b], non_blocking=True)
            elif self.device.type == "cuda" and self._pin_file:
                pages = device_view(src)
                w = _width(pages, out)
                torch.index_select(_wide(pages, w), 0, self.stream.rows_on_device(l)[a:b], out=_wide(out, w))
            else:
                out.copy_(src.index_select(0, cold.rows[a:b].long()))

    def close(self) -> None:
        for addr in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(addr)
        self._pinned.clear()


def streamed_rows(n: int, share: float) -> int:
    """How many of a layer's n CPU-shard rows (its first, the hottest) a step with ``share`` streams."""
    return int(round(n * share))


def _mats(cold: FFNShard) -> list[torch.Tensor]:
    """The shard's row matrices: up, gate (if any), down_t."""
    return [t for t in (cold.up, cold.gate, cold.down_t) if t is not None]


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _width(*ts: torch.Tensor) -> int:
    """The widest integer size (bytes) that divides a row of each row-major t [R, c] and its
    address: a gather of rows viewed so moves the bytes in as few, wide loads as it can."""
    return next(w for w in _INTS if all(t.shape[1] * t.element_size() % w == 0 and t.data_ptr() % w == 0
                                        for t in ts))


def _wide(t: torch.Tensor, w: int) -> torch.Tensor:
    """The bytes of t [R, c] as [R, c * element size / w] of the w-byte integer type."""
    return t.view(torch.uint8).view(_INTS[w])


class RowStream:
    """A step's chunks of streamed rows (``ColdRows.begin``: (layer, a, b) in the order the step
    computes them) through two device buffers that take turns: ``start`` begins filling the first
    two; ``take`` hands the next chunk's rows (the compute stream waits for its fill); ``done``
    says the compute on them is issued, and that buffer's next fill follows it on the copy stream.
    On CUDA the fills run on a stream of their own, beside the step's compute (the next layer's
    first rows while this layer's last are computed on); elsewhere they run in line."""

    def __init__(self, cold: ColdRows) -> None:
        self.cold, self.cuda = cold, cold.device.type == "cuda"
        mats = [_mats(sh) for sh in cold.rows if sh.n]
        row_bytes = max(sum(t.shape[1] * t.element_size() for t in m) for m in mats)
        # rows per chunk: STREAM_BYTES a buffer, no more than a layer's shard holds
        self.rows = max(1, min(STREAM_BYTES // row_bytes, max(sh.n for sh in cold.rows)))
        self.bufs = [[torch.empty(self.rows, t.shape[1], dtype=t.dtype, device=cold.device) for t in mats[0]]
                     for _ in range(2)]  # [R, D] (quantized: [R, blocks' bytes]) each
        self.copy = torch.cuda.Stream(cold.device) if self.cuda else None
        self.ready: list[torch.cuda.Event | None] = [None, None]
        self.free: list[torch.cuda.Event | None] = [None, None]
        self.jobs: list[tuple[int, int, int]] = []
        self.filled = self.taken = 0
        self.bias: dict[int, torch.Tensor] = {}  # in place: per layer, the shard's up bias on the device
        self._rows_dev: dict[int, torch.Tensor] = {}

    def rows_on_device(self, l: int) -> torch.Tensor:
        """Layer l's shard rows in the file [n] (int64) on the device (an in-place shard's)."""
        if l not in self._rows_dev:
            self._rows_dev[l] = self.cold.rows[l].rows.to(self.cold.device, torch.int64)
        return self._rows_dev[l]

    def swapped(self, l: int, at: torch.Tensor, new: torch.Tensor) -> None:
        """Re-placement (between steps): the in-place shard's rows ``at`` are now the file's rows
        ``new``; their device indices and bias follow, in place (nothing is allocated that stays)."""
        at = at.to(self.cold.device)
        if l in self._rows_dev:
            self._rows_dev[l][at] = new.to(self.cold.device, torch.int64)
        if l in self.bias:
            self.bias[l][at] = self.cold.rows[l].up_bias[new.long()].to(self.cold.device, torch.float32)

    def start(self, jobs: list[tuple[int, int, int]]) -> None:
        self.jobs, self.filled, self.taken = jobs, 0, 0
        if self.cuda:  # after what was enqueued before the step (a re-placement's indices, in place)
            self.copy.wait_stream(torch.cuda.current_stream(self.cold.device))
        for _ in range(min(2, len(jobs))):
            self._fill_next()

    def _fill_next(self) -> None:
        l, a, b = self.jobs[self.filled]
        i = self.filled % 2
        self.filled += 1
        if not self.cuda:
            self.cold.fill(self.bufs[i], l, a, b)
            return
        with torch.cuda.stream(self.copy):
            if self.free[i] is not None:
                self.copy.wait_event(self.free[i])  # the compute on this buffer's last rows is done
            self.cold.fill(self.bufs[i], l, a, b)
            self.ready[i] = torch.cuda.Event()
            self.ready[i].record(self.copy)

    def take(self, l: int) -> tuple[int, int, list[torch.Tensor | None]]:
        """The next chunk (layer l's): (a, b, [up, gate or None, down_t] rows [b - a, ...])."""
        jl, a, b = self.jobs[self.taken]
        assert jl == l, f"layer {l} asked for streamed rows, the step's next chunk is layer {jl}'s"
        i = self.taken % 2
        if self.cuda:
            torch.cuda.current_stream(self.cold.device).wait_event(self.ready[i])
        views = [t[:b - a] for t in self.bufs[i]]
        gated = self.cold.rows[l].gate is not None
        return a, b, [views[0], views[1] if gated else None, views[-1]]

    def done(self) -> None:
        i = self.taken % 2
        self.taken += 1
        if self.cuda:
            self.free[i] = torch.cuda.Event()
            self.free[i].record(torch.cuda.current_stream(self.cold.device))
        if self.filled < len(self.jobs):
            self._fill_next()
