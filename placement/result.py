"""Placement: which FFN neurons and attention KV-head groups of each layer live on the GPU.

Everything not on the GPU is on the CPU: a boolean mask per layer assigns each neuron to exactly
one device (the paper's eq. 3). `verify` re-checks the solved constraints from the masks alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .costs import GIB, ModelCosts, format_bytes


class PlacementError(ValueError):
    """A placement that breaks one of its constraints, or does not match the model."""


@dataclass
class Placement:
    """Result of the solver.

    gpu_neurons      [L] bool masks [n_ff_l], True = neuron on the GPU
    gpu_attention    [L, K] bool, True = KV-head group (its q/k/v/o heads and KV cache) on the GPU
    budget_bytes     the GPU budget it was solved for
    objective        sum of the impact served by the GPU (eq. 2; attention groups included)
    status           solver status ("optimal", "time_limit", "greedy")
    gpu_share        fraction of all FFN activations served by GPU neurons
    method           "ilp" or "greedy"
    group_size       neurons per solver group (grouped by frequency within a layer)
    min_gpu_neurons  [L] C_l enforced by eq. 5 (a layer holds 0 or >= C_l GPU neurons);
                     all 0 when the communication constraint was not enforced (greedy)
    solve_seconds    wall time of the solve
    """

    gpu_neurons: list[np.ndarray]
    gpu_attention: np.ndarray
    budget_bytes: int
    objective: float
    status: str
    gpu_share: float
    method: str = "ilp"
    group_size: int = 64
    min_gpu_neurons: tuple[int, ...] = field(default_factory=tuple)
    solve_seconds: float = 0.0

    # --- views ------------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return len(self.gpu_neurons)

    def gpu_counts(self) -> list[int]:
        """[L] GPU neurons per layer."""
        return [int(np.count_nonzero(m)) for m in self.gpu_neurons]

    def gpu_bucket(self, layer: int) -> np.ndarray:
        """[n_gpu] int32 sorted ids of the layer's GPU neurons (upstream's gpu_bucket)."""
        return np.flatnonzero(self.gpu_neurons[layer]).astype(np.int32)

    def gpu_ffn_bytes(self, costs: ModelCosts) -> int:
        return ffn_bytes_of(self.gpu_neurons, costs)

    def gpu_attention_bytes(self, costs: ModelCosts) -> int:
        return attention_bytes_of(np.count_nonzero(self.gpu_attention, axis=1), costs)

    def gpu_bytes(self, costs: ModelCosts) -> int:
        """Everything this placement puts on the GPU: fixed parts + attention + FFN."""
        return costs.fixed_bytes + self.gpu_attention_bytes(costs) + self.gpu_ffn_bytes(costs)

    def cpu_bytes(self, costs: ModelCosts) -> int:
        """What the CPU holds: CPU neurons and CPU attention groups (with their KV cache)."""
        return costs.ffn_bytes + costs.attention_bytes - self.gpu_ffn_bytes(costs) - self.gpu_attention_bytes(costs)

    def summary(self, costs: ModelCosts) -> str:
        """A few lines for the CLI."""
        n_gpu, n_all = sum(self.gpu_counts()), sum(costs.n_ff)
        n_attn = int(np.count_nonzero(self.gpu_attention))
        return (f"placement ({self.method}, {self.status}, {self.solve_seconds:.2f} s): "
                f"GPU {format_bytes(self.gpu_bytes(costs))} of {format_bytes(self.budget_bytes)}; "
                f"FFN neurons on GPU {n_gpu}/{n_all} ({n_gpu / n_all:.1%}) serving "
                f"{self.gpu_share:.1%} of activations; attention groups on GPU "
                f"{n_attn}/{self.gpu_attention.size}; objective {self.objective:.4g}")

    # --- checks -----------------------------------------------------------------------------
    def verify(self, costs: ModelCosts, budget_bytes: int | None = None,
               cpu_capacity_bytes: int | None = None) -> None:
        """Re-check every constraint from the masks; raise PlacementError with the numbers.

        shapes   one mask of n_ff_l booleans per layer: each neuron on exactly one device (eq. 3)
        eq. 4    GPU bytes (fixed + attention + FFN) <= budget; CPU bytes <= cpu capacity if given
        eq. 5-6  per layer: GPU neurons == 0 or >= min_gpu_neurons[l]
        """
        budget = self.budget_bytes if budget_bytes is None else int(budget_bytes)
        self._verify_shapes(costs)
        used = self.gpu_bytes(costs)
        if used > budget:
            raise PlacementError(
                f"eq. 4 (GPU memory): placement needs {used} bytes ({used / GIB:.3f} GiB), expected "
                f"<= budget {budget} bytes ({budget / GIB:.3f} GiB); fixed {costs.fixed_bytes}, "
                f"attention {self.gpu_attention_bytes(costs)}, FFN {self.gpu_ffn_bytes(costs)}")
        if cpu_capacity_bytes is not None and self.cpu_bytes(costs) > cpu_capacity_bytes:
            raise PlacementError(f"eq. 4 (CPU memory): CPU holds {self.cpu_bytes(costs)} bytes, "
                                 f"expected <= {cpu_capacity_bytes}")
        for layer, (n, c) in enumerate(zip(self.gpu_counts(), self.min_gpu_neurons)):
            if 0 < n < c:
                raise PlacementError(
                    f"eq. 5 (communication) layer {layer}: {n} GPU neurons, expected 0 or >= C_l={c} "
                    f"(fewer are not worth a CPU-GPU sync)")

    def _verify_shapes(self, costs: ModelCosts) -> None:
        if self.n_layer != costs.n_layer:
            raise PlacementError(f"gpu_neurons: expected {costs.n_layer} layers, got {self.n_layer}")
        for layer, (mask, n_ff) in enumerate(zip(self.gpu_neurons, costs.n_ff)):
            _check_mask(f"gpu_neurons[{layer}]", mask, (n_ff,))
        _check_mask("gpu_attention", self.gpu_attention, (costs.n_layer, costs.n_kv_groups))
        if self.min_gpu_neurons and len(self.min_gpu_neurons) != costs.n_layer:
            raise PlacementError(f"min_gpu_neurons: expected {costs.n_layer} entries, "
                                 f"got {len(self.min_gpu_neurons)}")


def _check_mask(name: str, mask: np.ndarray, shape: tuple[int, ...]) -> None:
    """A device mask: the given shape, boolean (so each unit is on exactly one device)."""
    mask = np.asarray(mask)
    if mask.shape != shape:
        raise PlacementError(f"{name}: expected shape {shape} (one entry per unit, each on exactly "
                             f"one device), got {mask.shape}")
    if mask.dtype != np.bool_:
        raise PlacementError(f"{name}: expected a bool mask (True = GPU), got dtype {mask.dtype}")


def ffn_bytes_of(gpu_neurons: Sequence[np.ndarray], costs: ModelCosts) -> int:
    """Bytes of the FFN neurons that per-layer masks [L][n_ff_l] put on the GPU."""
    return sum(int(np.count_nonzero(m)) * b for m, b in zip(gpu_neurons, costs.neuron_bytes))


def attention_bytes_of(groups: Sequence[int], costs: ModelCosts) -> int:
    """Bytes of ``groups[l]`` KV-head groups of each layer on the GPU (weights and KV cache)."""
    return sum(int(n) * b for n, b in zip(groups, costs.attn_unit_bytes))


def gpu_share(gpu_neurons: Sequence[np.ndarray], freqs: Sequence[np.ndarray]) -> float:
    """Fraction of FFN activations served by GPU neurons: sum f[gpu] / sum f (0 if no activity)."""
    total = sum(float(f.sum()) for f in freqs)
    served = sum(float(f[m].sum()) for f, m in zip(freqs, gpu_neurons))
    return served / total if total > 0 else 0.0
