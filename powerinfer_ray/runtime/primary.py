"""The primary executor: the one process that drives its GPU (or, on a host without one, the CPU
primary: one code path, placed by device). It holds its weights (``weights.py``) and runs every
layer of every step by the layer schedule (``schedule.py``), exchanging with the CPU executor
over the shared-memory channel (``exchange.py``).

A step is dispatched by its shape: decode steps (one token per sequence) of a CUDA primary run
as captured CUDA graphs (``graphs.DecodeGraphs``, one set per batch-size bucket, two where a
default zero-copy share is measured against none, ``graphs.ShareChoice``; every set captured
before serving: ``capture_graphs``); prefill chunks, and everything on a CPU primary, run the
schedule eagerly (``eager.EagerStep``), long prompts with the CPU shard's neurons computed here
(``cold.ColdRows``).

Dimension legend: B sequences, T tokens per sequence in a step, V vocab.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from ..model.config import ModelConfig
from ..model.source import WeightSource, open_model
from ..model.staging import pinned_staging
from .activity import COUNTED, ActivityCounts
from .channel import ChannelSpec
from .cold import ColdRows
from .eager import EagerStep, Sink
from .exchange import Exchange
from .hostmem import process_memory
from .graphs import GRAPH_POLICIES, DecodeGraphs, GraphCaptureError, ShareChoice, bucket_of, buckets
from .layers import Policy
from .plan import Plan, Swap
from .sampling import Burst
from .schedule import Item, run_eager, step_schedule
from .sharedshard import SharedShardSpec, fill
from .stats import ExecStats
from .weights import DTYPES, PrimaryWeights

log = logging.getLogger(__name__)
# torch threads while loading (the rows a file holds are gathered out of its map in parallel); the
# actor reserves one CPU, but at load time the host's cores are otherwise idle
LOAD_THREADS = 8


class PrimaryExecutor:
    """Runs the whole per-layer pipeline on its device, with the CPU executor as its partner."""

    def __init__(self, model: str | WeightSource, plan: Plan, *, device: str = "cpu",
                 policy: str = "predictor", threshold: float | None = None, margin: float = 0.0, slots: int = 8,
                 n_ctx: int | None = None, t_max: int = 128, dtype: str | None = None,
                 timeout_s: float = 60.0, prefill_dense_min: int | None = None,
                 graphs: bool | None = None, zero_copy: float | None = None,
                 prefill_share: float | None = None) -> None:
        """slots: sequences of the KV caches; t_max: tokens per step; prefill_dense_min: prompt
        chunks of at least this many tokens compute the CPU shard here, shorter ones its
        ``prefill_share`` (``ColdRows``); graphs: decode
        steps as captured CUDA graphs (None: on CUDA; on the CPU True runs the same fixed-shape
        segments eagerly, which is what the CPU tests check); zero_copy: the share of the CPU
        shard's neurons this executor computes in decode steps from their rows in host memory
        (``ColdRows``; None: its default by batch size on CUDA, none on the CPU)."""
        t0 = time.perf_counter()
        self.src = open_model(model)
        cfg = self.src.config
        self.phases = {"open": time.perf_counter() - t0}
        plan.verify(cfg)
        self.policy = Policy.for_model(policy, threshold, cfg, margin)
        self.device = torch.device(device)
        dt = DTYPES[dtype or (cfg.float_dtype if self.device.type == "cuda" else "f32")]
        self.t_max, self.timeout_s = t_max, timeout_s
        self.stats = ExecStats()
        if self.device.type == "cuda":
            # cuDNN's SDPA plans per shape: every decode step has a new key length, and each
            # re-plan costs milliseconds of host time
            torch.backends.cuda.enable_cudnn_sdp(False)
        t1 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, min(LOAD_THREADS, os.cpu_count() or 1)))  # gathers of file rows
        try:
            self.weights = PrimaryWeights(self.src, plan, self.policy, self.device, dt, slots,
                                          min(n_ctx or cfg.n_ctx, cfg.n_ctx))
        finally:
            torch.set_num_threads(threads)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phases["weights"] = time.perf_counter() - t1
        self.phases.update({f"weights.{k}": v for k, v in self.weights.phases.items()})
        self.cold = ColdRows(self.src, plan, dt, self.device, self.stats, prefill_dense_min, zero_copy,
                             prefill_share, masked=self.policy.name == "predictor")
        # per layer: the primary's neurons, then the CPU's (the predictor's columns; ``activity``)
        self.activity = ActivityCounts([np.concatenate([lp.gpu_neurons, lp.cpu_neurons]) for lp in plan.layers],
                                       self.device, self.policy.name in COUNTED)
        self.exchange: Exchange | None = None
        self.use_graphs = ((self.device.type == "cuda") if graphs is None else bool(graphs)) \
            and self.policy.name in GRAPH_POLICIES
        # by batch-size bucket (``capture_graphs``): one set, or sets at zero-copy shares to choose from
        self.graphs: dict[int, DecodeGraphs | ShareChoice] = {}
        self._said_uncaptured = False
        self._schedules: dict[float, list[Item]] = {}  # eager steps, by the share of the CPU shard run here
        # predictor samples (``runtime.engine_samples``, policy 'oracle': each neuron's true h): every
        # step then runs eagerly and densely
        self.sample_sink: Sink | None = None
        self.load_s = time.perf_counter() - t0  # reading (or generating) its shard

    @property
    def cfg(self) -> ModelConfig:
        return self.weights.cfg

    @property
    def plan(self) -> Plan:
        return self.weights.plan

    # --- setup (the executor group calls these) --------------------------------------------------
    def ready(self) -> dict:
        """What the group's start script reads: bytes held, the load's phases in seconds, and
        this process's host memory."""
        return {"device": str(self.device), "weight_bytes": self.weight_bytes(), "load_s": self.load_s,
                "phases": {k: round(v, 3) for k, v in self.phases.items()}, "memory": process_memory(),
                "placed": self.plan.placed()}

    def create_channel(self) -> ChannelSpec | None:
        """Create the shared-memory channel to the CPU executor (None: the plan needs no CPU)."""
        if not self.plan.needs_cpu_executor:
            return None
        w = self.weights
        self.exchange = Exchange(self.cfg.n_embd, self.t_max, w.slots, self.plan.max_cpu_neurons, w.dtype,
                                 self.device, self.stats, self.timeout_s)
        return self.exchange.spec

    def fill_cold(self, spec: SharedShardSpec) -> None:
        """Make the CPU executor's rows here and write them into its shared file (laid out with
        ``defer_fill``): for sources that make rows faster on this device (``rows_faster_on``)."""
        fill(spec, self.src, self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the layers' rows passed through: give their blocks back

    def attach_cold(self, spec: SharedShardSpec | None) -> str | None:
        """The CPU shard's rows for dense prefill of long prompts (``ColdRows.attach``)."""
        return self.cold.attach(spec)

    def capture_graphs(self) -> dict[int, float]:
        """Capture the decode graphs of every batch-size bucket the engine admits (``graphs.buckets``
        of its slots; on a CPU primary: build their segments), in one memory pool, before serving:
        no step waits for a capture. After the channel and the CPU shard's rows (zero-copy) are
        set up; a bucket whose zero-copy share is a default gets a set without it too
        (``decode_shares``). Logs each bucket as it is done; returns the seconds of each bucket. A
        failed capture leaves decode steps eager (warned)."""
        if not self.use_graphs:
            return {}
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        side = torch.cuda.Stream(self.device) if cuda else None
        todo = [b for b in buckets(self.weights.slots) if b not in self.graphs]
        seconds: dict[int, float] = {}
        for i, b in enumerate(todo, 1):
            t0 = time.perf_counter()
            try:
                sets = [DecodeGraphs(self.weights, self.exchange, self.stats, b, self.activity, self.cold, pool, side,
                                     share) for share in self.decode_shares(b)]
                for g in sets:
                    g.capture()
            except GraphCaptureError as e:
                log.warning("primary: decode graphs unavailable, running eager steps (%s)", e)
                self.use_graphs = False
                self.graphs.clear()
                return seconds
            self.graphs[b] = sets[0] if len(sets) == 1 else ShareChoice(sets)
            seconds[b] = time.perf_counter() - t0
            self.stats.graph_captures += 1
            self.stats.capture_s += seconds[b]
            log.info("primary: decode graphs of %d sequences %s in %.2f s (%d of %d)%s", b,
                     "captured" if cuda else "built", seconds[b], i, len(todo),
                     f", zero-copy shares {[g.share for g in sets]}" if len(sets) > 1 else "")
        return seconds

    def decode_shares(self, B: int) -> list[float]:
        """The zero-copy shares of the decode graphs of B sequences (``ColdRows.shares``): with a CPU
        executor to share with and the predictor's split (whose mask the CPU's rows are split by)."""
        if self.exchange is None or self.policy.name != "predictor":
            return [0.0]
        return self.cold.shares(B)

    def weight_bytes(self) -> int:
        return self.weights.weight_bytes()

    def read_bytes_per_step(self) -> int:
        return self.weights.read_bytes_per_step()

    # --- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int], argmax: bool = False) -> np.ndarray:
        """Run B sequences of T new tokens each (same T for all) from positions start_pos;
        returns the logits of each sequence's last token [B, V] (float32), or with ``argmax`` their
        argmax [B] (int64: greedy next tokens; a decode graph finds it on the device, and only the
        ids come back)."""
        B, T = len(tokens), len(tokens[0])
        assert all(len(t) == T for t in tokens), "a step runs sequences of equal token counts"
        if B * T > self.t_max and self.exchange is not None:
            raise ValueError(f"step of {B}x{T} tokens exceeds the channel's {self.t_max}")
        self._check_context(start_pos, T)
        if self.sample_sink is not None and self.plan.max_cpu_neurons and self.cold.share_for(B * T) < 1:
            raise ValueError(f"a step of {B * T} tokens with a sample sink: all the CPU shard's neurons run on the "
                             f"primary only in steps of at least prefill_dense_min={self.cold.min_tokens} tokens (dense "
                             f"prefill {'on' if self.cold.rows is not None else 'off'}); set prefill_dense_min=1")
        t0 = time.perf_counter()
        if self.activity.on:  # before the step: a concurrent read never sees more counts than tokens
            self.activity.tokens += B * T
        out = self._graph_step(slots, tokens, start_pos, argmax)
        on_graphs = out is not None
        if out is None:
            out = self._eager_step(slots, tokens, start_pos)
            out = out.argmax(axis=1) if argmax else out
        self._count(1, B * T, t0, on_graphs)
        return out

    def serve_step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int],
                   burst: Burst | None = None) -> np.ndarray | tuple[np.ndarray, list]:
        """What the coordinator's step call gets: ``step``'s logits [B, V], or for a burst its decode
        steps back to back: the tokens chosen [n, B] and the samplers' states. A greedy burst on
        decode graphs chains its steps on the device (``DecodeGraphs.run_burst``), any other runs
        step by step (``Burst.run``)."""
        if burst is None:
            return self.step(slots, tokens, start_pos)
        g = self._graphs_of(tokens) if burst.greedy else None
        if g is not None:
            return self._graph_burst(g, slots, [t[0] for t in tokens], start_pos, burst.n), [None] * len(slots)
        return burst.run(lambda toks, pos, argmax=False: self.step(slots, toks, pos, argmax),
                         [t[0] for t in tokens], start_pos)

    def _check_context(self, start_pos: list[int], T: int) -> None:
        end = max(start_pos) + T
        if end > self.weights.n_ctx:
            raise ValueError(f"sequence reaches {end} tokens, beyond the context n_ctx={self.weights.n_ctx}")

    def _graphs_of(self, tokens: list[list[int]]) -> DecodeGraphs | ShareChoice | None:
        """The graph set of a decode step of these sequences; None (run it eagerly) when the step is
        not one for graphs or they were not captured (``capture_graphs`` was not called): a step never
        captures."""
        if len(tokens[0]) != 1 or not self.use_graphs or self.sample_sink is not None:
            return None
        g = self.graphs.get(bucket_of(len(tokens), self.weights.slots))
        if g is None and not self._said_uncaptured:
            self._said_uncaptured = True
            log.warning("primary: decode graphs of %d sequences not captured (capture_graphs before serving): "
                        "eager decode steps", len(tokens))
        return g

    def _graph_step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int],
                    argmax: bool) -> np.ndarray | None:
        """The decode step on its bucket's graphs; None when it has none (``_graphs_of``)."""
        g = self._graphs_of(tokens)
        return None if g is None else g.run(list(slots), [t[0] for t in tokens], list(start_pos), argmax)

    def _graph_burst(self, g: DecodeGraphs | ShareChoice, slots: list[int], tokens: list[int], start_pos: list[int],
                     n: int) -> np.ndarray:
        """n greedy decode steps chained on the graphs (``DecodeGraphs.run_burst``): the tokens [n, B]."""
        B = len(tokens)
        self._check_context(start_pos, n)
        t0 = time.perf_counter()
        if self.activity.on:
            self.activity.tokens += B * n
        out = g.run_burst(list(slots), list(tokens), list(start_pos), n)
        self._count(n, B * n, t0, True)
        return out

    def _count(self, steps: int, tokens: int, t0: float, on_graphs: bool) -> None:
        """A call's steps into the stats: ``steps`` steps of ``tokens`` tokens in all, busy since t0
        (``time.perf_counter``), on the decode graphs or eager."""
        st, busy = self.stats, time.perf_counter() - t0
        st.steps += steps
        st.graph_steps += steps if on_graphs else 0
        st.tokens += tokens
        st.busy_s += busy
        st.graph_busy_s += busy if on_graphs else 0.0

    def _eager_step(self, slots: list[int], tokens: list[list[int]], start_pos: list[int]) -> np.ndarray:
        # an eager decode step streams nothing (unless a sample sink needs every neuron here)
        decode = len(tokens[0]) == 1 and self.sample_sink is None
        share = self.cold.share_for(len(tokens) * len(tokens[0]), decode)
        items = self._schedules.get(share)
        if items is None:
            items = self._schedules[share] = step_schedule(self.cfg, self.plan, self.policy.name, share)
        self.cold.begin(share)
        steps = EagerStep(self.weights, self.exchange, self.cold, self.stats, self.activity, slots, tokens,
                          start_pos, self.sample_sink)
        if self.exchange is not None:
            self.exchange.set_positions(list(slots), list(start_pos))
        run_eager(items, steps, self.exchange, self.stats, self._sync)
        return steps.logits

    def swap(self, swaps: list[Swap]) -> None:
        """Re-placement (``runtime.replacement``), between steps: each swap's neurons trade places
        with the CPU executor's (which swaps the same, between the same steps): rows copied in over
        the leaving ones (from the file's map, through pinned staging), the predictor's rows and
        the activity counters' columns follow. Tensors keep their addresses and sizes, so the
        captured decode graphs stay valid and the memory held does not change."""
        t0 = time.perf_counter()
        with pinned_staging(self.device):
            for s in swaps:
                self.weights.swap(s)
                self.cold.swap(s)
                ng = self.weights.layers[s.l].ffn.n
                self.activity.relabel(s.l, np.concatenate([s.gpu_rows, ng + s.cpu_rows]),
                                      np.concatenate([s.to_gpu, s.to_cpu]), self.cfg.n_ff)
        self._sync()
        self.stats.moved_neurons += sum(len(s) for s in swaps)
        self.stats.move_s += time.perf_counter() - t0

    def activation_counts(self, reset: bool = False) -> tuple[np.ndarray, int]:
        """The activation counts this executor kept (``activity``): [L, n_ff] by model neuron id
        (int64) and the tokens counted; reset: start afresh."""
        self._sync()
        counts, tokens = self.activity.model_counts(self.cfg.n_ff), self.activity.tokens
        if reset:
            self.activity.reset()
        return counts, tokens

    def activity_totals(self) -> tuple[int, int]:
        """(tokens counted, (token, neuron) pairs counted): ``stats()``'s summary, one scalar read."""
        return self.activity.tokens, self.activity.active()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # --- teardown --------------------------------------------------------------------------------
    def stop_peer(self) -> None:
        """Ask the CPU executor to stop serving (it answers before it stops)."""
        if self.exchange is not None:
            self.exchange.stop_peer()

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
        self.cold.close()
