"""Dense prefill of the CPU shard: for long prompts the primary computes the CPU executor's
neurons itself, densely, streaming their rows to its device once per chunk (upstream PowerInfer's
dense prefill). A GPU does a chunk of tokens over all of those rows faster than the CPU kernel
does the few active ones per token, and the exchange with the CPU executor drops out.

The rows are the CPU executor's own pages (``sharedshard``: one shared file, pinned here for
DMA), or, where they could not be shared, a host copy of the primary's own when it fits.
"""
from __future__ import annotations

import logging

import torch

from ..kernels.torch_ffn import apply_act_threshold
from ..model.reference import ffn_activation
from ..model.source import WeightSource
from .channel import pin_host
from .plan import Plan
from .shard import FFNShard, load_ffn_shard
from .sharedshard import SharedShardSpec, attach
from .stats import ExecStats

log = logging.getLogger(__name__)


class ColdRows:
    """The CPU shard's rows as the primary sees them, for prompts of at least ``min_tokens``
    tokens (None: 32 on CUDA, off on the CPU; 0: off)."""

    def __init__(self, src: WeightSource, plan: Plan, dtype: torch.dtype, device: torch.device,
                 stats: ExecStats, min_tokens: int | None) -> None:
        self.src, self.cfg, self.plan, self.dtype, self.device, self.stats = src, src.config, plan, dtype, device, stats
        self._auto = min_tokens is None
        self.min_tokens = (32 if device.type == "cuda" else 0) if min_tokens is None else min_tokens
        self.rows: list[FFNShard] | None = None  # per layer, once attached
        self.source: str | None = None  # "shared" (the CPU executor's pages) | "copy" (our own)
        self._pinned = 0  # address cudaHostRegister'ed (shared pages), for close()

    def attach(self, spec: SharedShardSpec | None) -> str | None:
        """Map the CPU executor's shared pages (``spec``), else make a host copy when it takes at
        most a third of the host's available memory; returns where the rows come from (None:
        dense prefill off)."""
        if self.rows is not None or self.min_tokens <= 0 or not any(len(lp.cpu_neurons) for lp in self.plan.layers):
            return self.source
        mapped = attach(spec) if spec is not None else None
        if mapped is not None:
            self.rows, buf = mapped
            self.source = "shared"
            if self.device.type == "cuda" and pin_host(buf.data_ptr(), buf.numel() * buf.element_size(),
                                                       "the shared CPU shard (dense prefill)"):
                self._pinned = buf.data_ptr()
            return self.source
        cold_bytes = sum(len(lp.cpu_neurons) for lp in self.plan.layers) * self.cfg.neuron_bytes
        avail = _host_available_bytes()
        if self._auto and avail is not None and cold_bytes > avail // 3:
            # a second host copy of the CPU shard would crowd the CPU executor's own
            log.warning("primary: dense prefill off: the CPU shard's %.1f GiB would take more than a third "
                        "of the host's %.1f GiB available", cold_bytes / 2**30, avail / 2**30)
            self.min_tokens = 0
            return None
        self.rows = [self._host_shard(l) for l in range(self.cfg.n_layer)]
        self.source = "copy"
        return self.source

    def _host_shard(self, l: int) -> FFNShard:
        """The CPU executor's rows of layer l, in (pinned) host memory."""
        sh = load_ffn_shard(self.src, l, self.plan[l].cpu_neurons, self.dtype, self.device)
        pin = self.device.type == "cuda"
        host = lambda t: None if t is None else (t.cpu().pin_memory() if pin else t)  # noqa: E731
        return FFNShard(sh.ids, host(sh.up), host(sh.gate), host(sh.down_t), host(sh.up_bias))

    def dense_for(self, n_tok: int) -> bool:
        """Whether a step of n_tok tokens computes the CPU shard here."""
        return self.rows is not None and n_tok >= self.min_tokens

    def ffn(self, l: int, x: torch.Tensor, mask: torch.Tensor | None, act_threshold: float | None = None,
            act_on: str = "gate", rows: int = 4096) -> torch.Tensor:
        """The CPU shard's FFN output [N, D] (fp32) for x [N, D], masked by the predictor's
        mask [N, n_cpu] when given and by a sparsified SwiGLU model's activation threshold;
        rows stream in chunks of ``rows`` (its device memory cost)."""
        cold, dev = self.rows[l], self.device
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=dev)
        for a in range(0, cold.n, rows):
            b = min(a + rows, cold.n)
            up = cold.up[a:b].to(dev, x.dtype, non_blocking=True)  # shared rows keep the CPU executor's dtype
            gate = cold.gate[a:b].to(dev, x.dtype, non_blocking=True) if cold.gate is not None else None
            u = x @ up.T  # [N, b-a]
            if cold.up_bias is not None:
                u = u + cold.up_bias[a:b].to(dev, u.dtype, non_blocking=True)  # fp32 bias: keep u's dtype
            g = x @ gate.T if gate is not None else None
            hid = ffn_activation(self.cfg.ffn_act, u, g)
            if act_threshold is not None:
                hid = apply_act_threshold(hid, g.float(), act_threshold, act_on)  # the criterion in fp32
            if mask is not None:
                hid = hid * mask[:, a:b]
            y += (hid @ cold.down_t[a:b].to(dev, hid.dtype, non_blocking=True)).float()
        self.stats.cold_neurons += int(mask.sum()) if mask is not None else x.shape[0] * cold.n
        self.stats.active_bytes += cold.n * self.cfg.neuron_bytes
        return y

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = 0


def _host_available_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
