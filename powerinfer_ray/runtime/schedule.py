"""The primary's step as one schedule: what a transformer block does, in order, written once.

Per layer (sequential attention; parallel attention, as in Falcon, posts one request for both):
    attn_in      attention norm                      [stage_attn, post OP_ATTN: the CPU's heads]
    attention    attention of the primary's heads    [await]
    attn_out     h += heads' partial outputs (+ the CPU's) + bias
    ffn_in       FFN norm, predictor, split          [stage_ffn, post OP_FFN: the CPU's neurons]
    ffn          the primary's active neurons        [cold: a share of the CPU's neurons here,
                                                      prompt chunks; the CPU executor the rest]
                                                     [await]
    ffn_out      h += FFN partial outputs (+ the CPU's) + bias
The step opens with ``embed`` and closes with ``head``.

Two sets of steps compute it (the same method names): ``eager.EagerStep`` over any shapes
(prefill chunks, eager decode), ``graphs.StepSegments`` over the fixed shapes of a decode step.
Two runners run it: ``run_eager`` here (step by step, each request posted once its inputs are
staged) and ``graphs.DecodeGraphs`` (the whole decode step as one CUDA graph, exchanges included).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..model.config import ModelConfig
from .channel import OP_ATTN, OP_ATTN_FFN, OP_FFN
from .cold import streamed_rows
from .exchange import Exchange
from .plan import LayerPlan, Plan
from .stats import ExecStats


@dataclass(frozen=True)
class Step:
    """Compute on the primary: ``op`` names the method of the step set; ``cpu``: a merge that
    adds the CPU executor's partial output."""

    op: str
    l: int = -1
    cpu: bool = False


@dataclass(frozen=True)
class Post:
    """Hand the CPU executor its share of layer ``l`` (its inputs are staged just before)."""

    op: int
    l: int
    n_mask: int  # width of the staged neuron mask (0: none; the CPU finds or takes all of its rows)


@dataclass(frozen=True)
class Await:
    """Wait for the CPU executor's answer to the last post."""

    l: int


Item = Step | Post | Await
PHASE = {"attn_in": "attn", "stage_attn": "attn", "attention": "attn", "attn_out": "attn",
         "ffn_in": "ffn", "stage_ffn": "ffn", "ffn": "ffn", "cold": "ffn", "ffn_out": "ffn"}


def mask_width(policy: str, n_cpu: int) -> int:
    """n_mask of the CPU executor's FFN requests for a shard of n_cpu neurons: the width of the
    primary's packed mask under 'predictor'; 0 under the policies whose CPU computes its rows
    without one ('dense', gate-first)."""
    return n_cpu if policy == "predictor" else 0


def layer_schedule(cfg: ModelConfig, lp: LayerPlan, l: int, policy: str, share: float = 0.0) -> list[Item]:
    """Layer l's items (see the module docstring). share: of the CPU shard's rows, the primary
    computes this share densely (``cold.ColdRows``, its first ``streamed_rows``); the CPU executor
    computes the rest (none at share 1)."""
    heads, n = len(lp.cpu_groups) > 0, len(lp.cpu_neurons)
    k = streamed_rows(n, share)
    cold, cpu_ffn = k > 0, k < n
    n_mask = mask_width(policy, n) if cpu_ffn else 0
    S = lambda op, cpu=False: Step(op, l, cpu)  # noqa: E731
    if cfg.parallel_attn:  # one request: the CPU answers with the sum of its parts
        items = [S("attn_in"), S("ffn_in")]
        if heads:
            items.append(S("stage_attn"))
        if cpu_ffn:
            items.append(S("stage_ffn"))
        if heads or cpu_ffn:
            items.append(Post(OP_ATTN_FFN if cpu_ffn else OP_ATTN, l, n_mask))
        items += [S("attention"), S("ffn")] + ([S("cold")] if cold else [])
        if heads or cpu_ffn:
            items.append(Await(l))
        return items + [S("ffn_out", heads or cpu_ffn)]
    items = [S("attn_in")]
    if heads:
        items += [S("stage_attn"), Post(OP_ATTN, l, 0)]
    items.append(S("attention"))
    if heads:
        items.append(Await(l))
    items += [S("attn_out", heads), S("ffn_in")]
    if cpu_ffn:
        items += [S("stage_ffn"), Post(OP_FFN, l, n_mask)]
    items += [S("ffn")] + ([S("cold")] if cold else [])
    if cpu_ffn:
        items.append(Await(l))
    return items + [S("ffn_out", cpu_ffn)]


def step_schedule(cfg: ModelConfig, plan: Plan, policy: str, share: float = 0.0) -> list[Item]:
    """A whole step: embed, every layer, head."""
    items: list[Item] = [Step("embed")]
    for l in range(cfg.n_layer):
        items += layer_schedule(cfg, plan[l], l, policy, share)
    return items + [Step("head")]


def run_eager(items: list[Item], steps: Any, exchange: Exchange | None, stats: ExecStats,  # noqa: ANN401
              sync: Callable[[], None]) -> None:
    """Run a schedule step by step on ``steps`` (an ``EagerStep`` or ``StepSegments``): each post
    as soon as its inputs are staged (``sync`` waits for the staging copies), so the CPU executor
    works while the primary computes its own share. Host time goes to stats.layer_s by phase."""
    pend = None
    phase, t = None, time.perf_counter()
    for it in items:
        if type(it) is Step:
            phase = PHASE.get(it.op)
            getattr(steps, it.op)(it)
        elif type(it) is Post:
            t0 = time.monotonic_ns()
            sync()
            stats.sync_s += (time.monotonic_ns() - t0) * 1e-9  # the staging copies (D2H)
            pend = exchange.post(it.op, it.l, steps.n_seq, steps.n_tok, it.n_mask)
        else:
            exchange.await_(*pend)
        now = time.perf_counter()
        if phase is not None:
            stats.layer_s[phase] += now - t
        t = now
