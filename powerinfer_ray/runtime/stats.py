"""The counters an executor keeps: ``stats()`` reports them and the actors export them as metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExecStats:
    """Load of one executor since it started."""

    steps: int = 0
    graph_steps: int = 0  # of which decode steps of the fixed-shape segments (CUDA graphs on a GPU)
    tokens: int = 0
    neurons: int = 0  # (token, neuron) pairs computed
    # weight bytes read: active rows once per step (the CPU executor's kernel: without the down rows it
    # skipped, zero activations; the GPU's counts them), attention in full
    active_bytes: int = 0
    busy_s: float = 0.0
    graph_busy_s: float = 0.0  # of which the graph steps' (host seconds around the GPU's, launch to result)
    exchanges: int = 0
    sync_s: float = 0.0  # notify + return latency + host copies, summed over exchanges
    peer_compute_s: float = 0.0
    peer_neurons: int = 0
    # the CPU shard's neurons this device computed (densely for long prompts; zero-copy in decode
    # steps): placed on the CPU, so the GPU share of activations counts them with the CPU's
    cold_neurons: int = 0
    host_read_bytes: int = 0  # weight bytes of the CPU shard's rows it read in host memory (zero-copy decode)
    streamed_bytes: int = 0  # weight bytes of the CPU shard's rows streamed to this device (prompt chunks)
    gpu_compute_s: float = 0.0  # GPU time of the decode graphs less their waits for answers (the GPU's clock)
    gpu_timed_steps: int = 0
    graph_captures: int = 0  # batch buckets whose decode graphs were captured (CPU primary: built), at start
    capture_s: float = 0.0  # and the host seconds they took
    # decode graph steps by the zero-copy share they ran at ("0.5": steps; graphs.ShareChoice)
    share_steps: dict[str, int] = field(default_factory=dict)
    kernel_s: float = 0.0  # CPU executor: inside the FFN kernel call (the rest of an answer is Python)
    kernel_bytes: int = 0  # CPU executor: the FFN rows those calls read, as stored (blocks: compressed)
    attn_s: float = 0.0  # CPU executor: in the attention of its KV-head groups
    # CPU executor: the same, of its answers to requests of one token per sequence (decode steps, and a
    # prompt chunk of one token): the decode exchange's own cost, without prompt chunks' long answers
    decode_exchanges: int = 0
    decode_busy_s: float = 0.0
    decode_kernel_s: float = 0.0
    decode_kernel_bytes: int = 0
    compiled_exchanges: int = 0  # CPU executor: of its exchanges, those its compiled serving loop answered
    moved_neurons: int = 0  # re-placement: neurons that came to this executor (runtime/replacement.py)
    move_s: float = 0.0  # and the host seconds it spent moving them in, between steps
    # seconds of eager steps (host): attn / ffn, wait (for the CPU's answers); of graph steps:
    # launch (host, the graph's launch), exchange (GPU clock: from a post until the GPU saw the
    # answer), segment (GPU clock: the rest of the step)
    layer_s: dict[str, float] = field(default_factory=lambda: {"attn": 0.0, "ffn": 0.0, "wait": 0.0, "launch": 0.0,
                                                               "segment": 0.0, "exchange": 0.0})

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["layer_s"] = dict(self.layer_s)
        d["share_steps"] = dict(self.share_steps)
        d["per_exchange_sync_us"] = 1e6 * self.sync_s / self.exchanges if self.exchanges else 0.0
        tot = self.neurons + self.peer_neurons + self.cold_neurons
        d["gpu_activation_share"] = self.neurons / tot if tot else 0.0
        return d
