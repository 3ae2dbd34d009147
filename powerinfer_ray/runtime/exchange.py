"""The primary's side of the per-layer exchange with the CPU executor, over the shared-memory
channel (``channel.py``): stage a layer's inputs in the channel, post the request, await the
answer, collect the CPU's partial output.

Staging copies are asynchronous on a GPU: the eager runner syncs the stream before it posts. A
decode graph's kernels read and write the channel themselves (``buffers``), post and await on
the GPU (``header_on_device``, ``kernels.triton_signal``), and the host waits for the step's end
(``wait_step``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .channel import GIVEN_UP, OP_STOP, REQUEST_FIELDS, Channel, ChannelSpec, PeerDied, device_view
from .stats import ExecStats

_X_DTYPE = {torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class ChannelBuffers:
    """The channel's buffers as the primary's kernels address them (``Exchange.buffers``)."""

    x_attn: torch.Tensor  # [T_max, D]
    x_ffn: torch.Tensor  # [T_max, D]
    out: torch.Tensor  # [T_max, D]: the CPU executor's answer
    mask: torch.Tensor  # uint8 [T_max * ceil(n_mask / 8)]: see Channel.mask_rows
    start_pos: torch.Tensor  # int64 [B_max]: each sequence's position (the CPU's heads read it)


class Exchange:
    """One channel to one CPU executor, created by the primary (``spec`` goes to the peer)."""

    def __init__(self, d: int, t_max: int, slots: int, n_mask: int, dtype: torch.dtype,
                 device: torch.device, stats: ExecStats, timeout_s: float) -> None:
        self.channel = Channel.create(d, t_max, slots, n_mask, _X_DTYPE.get(dtype, "f32"))
        if device.type == "cuda":
            self.channel.pin_for_cuda()
        self.device, self.stats, self.timeout_s = device, stats, timeout_s

    @property
    def spec(self) -> ChannelSpec:
        return self.channel.spec

    def header_on_device(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The page-locked header's req_seq [1], resp_seq [1] and request fields [5] (int64) as
        CUDA tensors over the same bytes, for a decode graph's post and await kernels
        (RuntimeError when the channel could not be page-locked: the GPU cannot address it)."""
        if not self.channel.pinned:
            raise RuntimeError("the channel is not page-locked: the GPU cannot address it")
        h = device_view(torch.from_numpy(self.channel.header).view(1, -1))[0]
        return h[0:1], h[1:2], h[REQUEST_FIELDS]

    def buffers(self) -> ChannelBuffers:
        """The channel's buffers on the primary's device: on CUDA tensors over the page-locked
        segment's bytes (RuntimeError when it could not be page-locked), else the host tensors."""
        ch = self.channel
        start_pos = torch.from_numpy(ch.start_pos)
        if self.device.type != "cuda":
            return ChannelBuffers(ch.x_attn, ch.x_ffn, ch.out, ch.mask, start_pos)
        if not ch.pinned:
            raise RuntimeError("the channel is not page-locked: the GPU cannot address it")
        return ChannelBuffers(device_view(ch.x_attn), device_view(ch.x_ffn), device_view(ch.out),
                              device_view(ch.mask.view(1, -1))[0], device_view(start_pos.view(1, -1))[0])

    # --- a step's inputs -------------------------------------------------------------------------
    def set_positions(self, slots: list[int], start_pos: list[int]) -> None:
        """The step's sequences (the CPU executor's heads read their KV slots and positions)."""
        ch, B = self.channel, len(slots)
        ch.slots[:B] = slots
        ch.start_pos[:B] = start_pos

    def stage_attn(self, x: torch.Tensor) -> None:
        """The attention input x [N, D] of the CPU's heads."""
        self.channel.x_attn[: x.shape[0]].copy_(x, non_blocking=True)

    def stage_ffn(self, x: torch.Tensor) -> None:
        """The FFN input x [N, D] of the CPU's neurons."""
        self.channel.x_ffn[: x.shape[0]].copy_(x, non_blocking=True)

    def stage_mask(self, packed: torch.Tensor, n_mask: int) -> None:
        """The CPU's active neurons, packed eight to a byte [N, ceil(n_mask / 8)] (``pack_mask``)."""
        torch.from_numpy(self.channel.mask_rows(packed.shape[0], n_mask)).copy_(packed, non_blocking=True)

    # --- the exchange ----------------------------------------------------------------------------
    def post(self, op: int, l: int, n_seq: int, n_tok: int, n_mask: int) -> tuple[int, int]:
        """Publish a request whose inputs are staged (and their copies done); (seq, t_post_ns)."""
        t_post = time.monotonic_ns()
        return self.channel.post(op, l, n_seq, n_tok, n_mask), t_post

    def await_(self, seq: int, t_post: int) -> int:
        """Wait for the answer to request ``seq`` (posted at ``t_post``) and count the exchange:
        the peer's compute, the sync (notify + return latency) and the host's wait. Returns when
        the answer was seen (``time.monotonic_ns``)."""
        t_start, t_end = self.channel.wait_response(seq, self.timeout_s, spin_s=0.05)
        t_seen = time.monotonic_ns()
        st = self.stats
        st.exchanges += 1
        st.peer_compute_s += (t_end - t_start) * 1e-9
        st.sync_s += ((t_start - t_post) + (t_seen - t_end)) * 1e-9
        st.layer_s["wait"] += (t_seen - t_post) * 1e-9
        return t_seen

    def wait_step(self, done: torch.cuda.Event, before: tuple[int, int, int]) -> tuple[int, int, int]:
        """Wait for a decode graph (which posts and awaits by itself) to reach ``done``; raise
        when the CPU executor died, did not answer in timeout_s (then every wait of the graph
        is ended first: the GPU stops spinning) or failed a layer. Returns the growth of the
        channel's counters (requests, failures, peer ns) since ``before`` (read before the launch)."""
        ch = self.channel
        try:
            ch.wait(done.query, self.timeout_s, "the CPU executor's answers in a decode step")
        except PeerDied:
            while not done.query():  # an answer written late must not restart a wait
                ch.abort()
                time.sleep(1e-3)
            raise
        if ch.aborted:  # given up on in an earlier step: the graph's waits all passed at once
            raise PeerDied(GIVEN_UP)
        grown = tuple(a - b for a, b in zip(ch.counters(), before))
        if grown[1]:
            raise RuntimeError(f"CPU executor failed on {grown[1]} of the step's {grown[0]} requests; see its log")
        return grown

    def collect(self, n_tok: int) -> torch.Tensor:
        """The CPU's partial output [N, D] of the last answered request, on the primary's device."""
        return self.channel.out[:n_tok].to(self.device, non_blocking=True)

    def stop_peer(self, timeout_s: float = 5.0) -> None:
        """Ask the CPU executor to stop serving, and wait for it to say so (unless the channel
        was given up on: then no answer can be told from one)."""
        ch = self.channel
        seq = ch.post(OP_STOP, 0, 0, 0, 0)
        if not ch.aborted:
            ch.wait_response(seq, timeout_s=timeout_s)

    def close(self) -> None:
        self.channel.close(unlink=True)

