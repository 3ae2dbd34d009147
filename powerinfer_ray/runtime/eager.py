"""The layer schedule's steps over any shapes: B sequences of T new tokens each (prefill chunks,
and decode steps where they do not run as graphs). Active sets and counts come back to the host
as they are found; a share of the CPU shard's neurons can run densely here (``cold.ColdRows``).

A sample sink (``Sink``: predictor training samples, ``runtime.engine_samples``) sees, per layer,
the predictor input and the activations h of every neuron of the layer: the primary's own
(computed again outside the fused FFN kernel, which keeps them inside) and, in a dense step, the
CPU shard's (as ``ColdRows`` computes them). Without a sink none of this runs.

Dimension legend: B sequences, T tokens per sequence, N = B*T, D hidden, V vocab.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .activity import ActivityCounts
from .channel import pack_mask
from .cold import ColdRows
from .exchange import Exchange
from .layers import add_partials, attn_partial, ffn_bytes, ffn_partial, shard_activation
from .schedule import Step
from .stats import ExecStats
from .weights import PrimaryWeights

# (layer, predictor input [N, D] fp32, h [N, n_ff] fp32 of every neuron in model order), as
# ``FFNHooks.observe`` sees them on the dense reference
Sink = Callable[[int, torch.Tensor, torch.Tensor], None]


class EagerStep:
    """One step's state and steps (the names ``schedule.py`` lists); ``logits`` [B, V] after ``head``."""

    def __init__(self, w: PrimaryWeights, exchange: Exchange | None, cold: ColdRows, stats: ExecStats,
                 activity: ActivityCounts, slots: list[int], tokens: list[list[int]], start_pos: list[int],
                 sink: Sink | None = None) -> None:
        self.w, self.ex, self.cold_rows, self.stats, self.act = w, exchange, cold, stats, activity
        self.sink = sink
        self.h_own = self.h_cold = None  # with a sink: the layer's h [N, n_gpu], [N, n_cpu]
        self.B, self.T = len(tokens), len(tokens[0])
        self.n_seq, self.n_tok = self.B, self.B * self.T
        self.tok = torch.tensor(tokens, dtype=torch.long, device=w.device).reshape(-1)  # [N]
        # host lists: the attention kernel slices the cache without a sync
        self.slots, self.start = list(slots), list(start_pos)
        self.h = self.x_a = self.x_f = self.a = self.f = self.c = None  # [N, D] each
        self.gmask = self.cmask = None  # predicted activity [N, n_gpu], [N, n_cpu] (bool)
        self.logits: np.ndarray | None = None

    def embed(self, s: Step) -> None:
        w, pos = self.w, None
        if w.pos_embd is not None:
            pos = torch.tensor([[p + t for t in range(self.T)] for p in self.start], device=w.device).reshape(-1)
        self.h = w.embed(self.tok, pos)  # [N, D]: the residual stream stays fp32

    def attn_in(self, s: Step) -> None:
        self.x_a = self.w.norm(self.h, self.w.layers[s.l].norm_attn)

    def stage_attn(self, s: Step) -> None:
        self.ex.stage_attn(self.x_a)

    def attention(self, s: Step) -> None:
        sh, D = self.w.layers[s.l].attn, self.w.cfg.n_embd
        self.a = None
        if sh.n_groups:
            x = self.x_a.view(self.B, self.T, D)
            self.a = attn_partial(x, sh, self.w.cfg, self.slots, self.start).view(self.n_tok, D)

    def attn_out(self, s: Step) -> None:
        cpu = self.ex.collect(self.n_tok) if s.cpu else None
        self.h = add_partials(self.h.clone(), [self.a, cpu], self.w.layers[s.l].attn_bias)

    def ffn_in(self, s: Step) -> None:
        """FFN norm, and the predictor's split: the primary's active neurons and the CPU's."""
        w, lw = self.w, self.w.layers[s.l]
        self.x_f = w.norm(self.h, lw.norm_ffn) if lw.norm_ffn else self.x_a
        self.gmask = self.cmask = None
        if w.policy.name == "predictor":
            active = w.predict(s.l, self.h) >= w.policy.threshold  # [N, n_gpu + n_cpu]
            self.act.add(s.l, active)
            ng = lw.ffn.n
            self.gmask, self.cmask = active[:, :ng], (active[:, ng:] if active.shape[1] > ng else None)

    def stage_ffn(self, s: Step) -> None:
        self.ex.stage_ffn(self.x_f)
        if self.cmask is not None:
            k = self.cold_rows.k[s.l] if self.cold_rows.k else 0
            mask = self.cmask
            if k:  # the rows streamed here: clear for the CPU executor
                mask = mask.clone()
                mask[:, :k] = False
            self.ex.stage_mask(pack_mask(mask), mask.shape[1])  # an eighth of the bytes

    def ffn(self, s: Step) -> None:
        w, pol, sh = self.w, self.w.policy, self.w.layers[s.l].ffn
        count = self.act.layers[s.l][:sh.n] if self.act.on and pol.name == "oracle" else None
        self.f, pairs, rows = ffn_partial(self.x_f, sh, w.cfg.ffn_act, pol.name, self.gmask,
                                          act_threshold=pol.act_threshold(s.l), act_on=pol.act_on, count=count)
        self.stats.neurons += pairs
        gate_rows = sh.n if pol.name == "gate-first" else rows  # gate-first: every gate row, up / down of `rows`
        self.stats.active_bytes += ffn_bytes(w.cfg, gate_rows, rows, rows)  # a row is read once per step
        if self.sink is not None:
            self.h_own = shard_activation(self.x_f, sh, w.cfg.ffn_act, pol.act_threshold(s.l), pol.act_on)

    def cold(self, s: Step) -> None:
        """The streamed share of the CPU shard's neurons (its first k rows), here."""
        pol, ng, k = self.w.policy, self.w.layers[s.l].ffn.n, self.cold_rows.k[s.l]
        count = self.act.layers[s.l][ng:ng + k] if self.act.on and pol.name == "oracle" else None
        if self.sink is not None:
            self.h_cold = torch.empty(self.n_tok, k, device=self.w.device)
        mask = None if self.cmask is None else self.cmask[:, :k]
        self.c = self.cold_rows.ffn(s.l, self.x_f, mask, pol.act_threshold(s.l), pol.act_on, count=count,
                                    h_out=self.h_cold)

    def ffn_out(self, s: Step) -> None:
        if self.sink is not None:
            self._observe(s.l)
        a = self.a if self.w.cfg.parallel_attn else None
        cpu = self.ex.collect(self.n_tok) if s.cpu else None
        self.h = add_partials(self.h.clone(), [a, self.f, self.c, cpu], self.w.layers[s.l].ffn_bias)
        self.c = None

    def _observe(self, l: int) -> None:
        """Hand the sink layer l's predictor input (the residual before the FFN norm, or the layer
        input with parallel attention: ``h`` until ``ffn_out`` adds to it) and every neuron's h."""
        parts = [(self.w.layers[l].ffn.ids, self.h_own)]
        if self.h_cold is not None:
            parts.append((self.cold_rows.rows[l].ids, self.h_cold))
        n_ff = self.w.cfg.n_ff
        assert sum(len(ids) for ids, _ in parts) == n_ff, \
            f"layer {l}: h of {sum(len(ids) for ids, _ in parts)} of {n_ff} neurons on the primary (a dense step?)"
        h = torch.empty(self.n_tok, n_ff, device=self.w.device)  # [N, n_ff]
        for ids, part in parts:
            h[:, torch.as_tensor(ids, dtype=torch.long, device=h.device)] = part
        self.sink(l, self.h, h)
        self.h_own = self.h_cold = None

    def head(self, s: Step) -> None:
        last = self.h.view(self.B, self.T, -1)[:, -1]  # [B, D]
        self.logits = self.w.head(last).cpu().numpy()
