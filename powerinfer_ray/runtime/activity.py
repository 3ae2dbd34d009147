"""Runtime activation counts: per layer, per neuron, the tokens in which the engine decided the
neuron active, kept while it serves so a user can re-solve the placement from their own traffic
(``powerinfer-ray solve --activation``).

What is counted, by policy (``COUNTED``):
  predictor   the predictor's decision, logit >= threshold (the margin applied), for every
              neuron of the layer: the primary decides the CPU executor's neurons too
  oracle      the true activity each executor finds for its own neurons (h != 0, or a
              sparsified SwiGLU model's criterion above its threshold): the primary for its
              rows and, in dense prefill, the CPU shard's rows it computes; the CPU executor
              for the rows it computes
  gate-first  nothing: the compiled CPU kernel thresholds the gate inside (its mask never
              leaves it); policy 'oracle' counts the same sets exactly
  dense       nothing: h exists only inside the FFN kernels, which compute every row
Each executor keeps its counters on its own device (static tensors: the decode graphs add
their masks into them in place, no host sync per layer); ``model_counts`` maps them back to
the model's neuron ids, and the engine sums its executors' (their neuron sets are disjoint),
read between two steps (the engine holds its step lock) so that both count the same tokens.
When re-placement gives a column another neuron (``relabel``), the column's count so far goes to
its neuron's total on the host and the column starts again from zero: the totals by neuron id
stay whole whichever executor counted them.

Dimension legend: N tokens of a step, n the counted neurons of a layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..offline.profile import ActivationStats

COUNTED = ("predictor", "oracle")


class ActivityCounts:
    """Counters [n_l] per layer (int64, on ``device``), column j of layer l counting model
    neuron ``ids[l][j]``; ``tokens``: the tokens counted (the primary's; a CPU executor's
    columns count the same tokens)."""

    def __init__(self, ids: list[np.ndarray], device: torch.device | str, on: bool) -> None:
        self.ids = [np.asarray(i, np.int64) for i in ids]
        self.on = on
        sizes = [len(i) for i in self.ids]
        self.flat = torch.zeros(sum(sizes) if self.on else 0, dtype=torch.int64, device=device)
        off = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        # per layer views of one buffer: one copy brings every layer back
        self.layers = [self.flat[off[l]:off[l + 1]] if self.on else None for l in range(len(sizes))]
        self.tokens = 0
        self.retired: dict[int, np.ndarray] = {}  # per layer [n_ff] int64: counts of relabelled columns

    def add(self, l: int, mask: torch.Tensor | None, start: int = 0) -> None:
        """Count mask [N, m] (bool: token, neuron active) into layer l's columns start..start+m.
        In place on a static tensor: safe inside a captured CUDA graph."""
        if self.on and mask is not None and mask.shape[1]:
            self.layers[l][start:start + mask.shape[1]] += mask.sum(0)

    def model_counts(self, n_ff: int) -> np.ndarray:
        """The counts by model neuron id [L, n_ff] (int64; neurons this executor does not count: 0)."""
        out = np.zeros((len(self.ids), n_ff), np.int64)
        if not self.on:
            return out
        flat = self.flat.cpu().numpy()
        off = 0
        for l, ids in enumerate(self.ids):
            out[l, ids] = flat[off:off + len(ids)]
            off += len(ids)
        for l, counts in self.retired.items():
            out[l] += counts
        return out

    def relabel(self, l: int, cols: np.ndarray, ids: np.ndarray, n_ff: int) -> None:
        """Columns ``cols`` of layer l count neurons ``ids`` from now on; what they counted so far
        stays with their old neurons (``retired``). Between steps (it reads the device)."""
        cols = np.asarray(cols, np.int64)
        if self.on and len(cols):
            idx = torch.from_numpy(cols).to(self.flat.device)
            got = self.layers[l][idx].cpu().numpy()
            np.add.at(self.retired.setdefault(l, np.zeros(n_ff, np.int64)), self.ids[l][cols], got)
            self.layers[l][idx] = 0
        self.ids[l] = self.ids[l].copy()
        self.ids[l][cols] = ids

    def active(self) -> int:
        """(token, neuron) pairs counted, all layers."""
        return int(self.flat.sum()) + sum(int(r.sum()) for r in self.retired.values()) if self.on else 0

    def reset(self) -> None:
        """Start counting afresh (in place: captured graphs keep adding into the same tensors)."""
        self.flat.zero_()
        self.tokens = 0
        self.retired.clear()


def cpu_counts(policy: str) -> bool:
    """Whether a CPU executor keeps counts of its own under this policy (under 'predictor' the
    primary counts every neuron): the engine reads its counts only then, since a read is a call
    into the process whose serving thread the next step waits for."""
    return policy == "oracle"


def check_counted(policy: str) -> None:
    """ValueError unless an engine of this policy keeps activation counts."""
    if policy not in COUNTED:
        raise ValueError(f"policy {policy!r}: the engine keeps activation counts under policies {COUNTED} only "
                         "(see runtime/activity.py); start the engine with policy 'oracle' (exact) or 'predictor'")


def activity_summary(policy: str, tokens: int, active: int, n_layer: int, n_ff: int) -> dict:
    """What ``stats()`` reports: the tokens counted and the mean share of a layer's neurons
    decided active on a token (``active``: the counted (token, neuron) pairs of all executors)."""
    return {"counted": policy in COUNTED, "tokens": tokens,
            "mean_active_fraction": active / (tokens * n_layer * n_ff) if tokens else 0.0}


def engine_activation(counts: list[np.ndarray], tokens: int, model: str) -> "ActivationStats":
    """The engine's counts: its executors' [L, n_ff] summed (disjoint neuron sets), over the
    primary's ``tokens``, as the offline profile's ``ActivationStats`` (its files, ``save``)."""
    from ..offline.profile import ActivationStats

    return ActivationStats(np.sum(counts, axis=0), tokens, model)
