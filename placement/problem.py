"""PlacementProblem: activation statistics + costs + budget + host, turned into placeable units.

This is the input both solvers (ilp.solve_ilp, ilp.solve_greedy) share. Labels follow the
PowerInfer paper (SOSP'24, section 6, "Neuron placement policy"):

  eq. 1  impact v_e of neuron e = its activation frequency f_e (activations per token)
  units  neurons of a layer sorted by frequency and cut into groups of `group_size` (64 like the
         paper): group g of layer l has size s_lg, impact sum(f) and bytes s_lg * neuron_bytes_l
  C_l    the communication threshold of eq. 5 (see communication_threshold)

Attention. When the attention of all layers (q/k/v/o weights + KV cache) fits next to the
fixed parts, it stays on the GPU and only FFN groups are placed. Otherwise each (layer, KV-head
group) becomes a unit too, with bytes = weights + KV cache of the group and

    impact = attention_weight * bytes / neuron_bytes_l

i.e. attention_weight "always-active neurons" per neuron-size of bytes. An attention group is
read in full by every token (frequency 1) together with its KV cache, so per GPU byte it saves
as much CPU DRAM traffic as a neuron of frequency 1, the most any neuron can. The default
attention_weight = 2 doubles that because CPU attention cannot overlap the GPU: the layer's FFN
needs the merged attention output first, so its CPU time sits on the critical path and costs
one more CPU-GPU sync. With weight > 1 an attention byte beats every FFN byte, so the solver
keeps as much attention on the GPU as fits and gives FFN neurons what is left; a weight below 1
lets very hot neurons displace attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .costs import GIB, ModelCosts, format_bytes
from .host import HostProfile
from .result import Placement, gpu_share

DEFAULT_GROUP_SIZE = 64  # the paper groups neurons of similar frequency in batches of 64
DEFAULT_ATTENTION_WEIGHT = 2.0


class InfeasibleBudgetError(ValueError):
    """No placement fits: the message says the smallest budget that would work."""

    def __init__(self, message: str, min_budget_bytes: int):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes

    def __reduce__(self):  # noqa: ANN204  (pickled across Ray with both arguments)
        return type(self), (str(self), self.min_budget_bytes)


class StatsError(ValueError):
    """Activation statistics that do not match the model."""


@dataclass
class PlacementProblem:
    """Placeable units of one solve. L layers, Gm = max groups per layer, K KV-head groups.

    freqs            [L][n_ff_l] activation frequency per neuron (counts / n_tokens)
    order            [L][n_ff_l] neuron ids, hottest first (group g = order[g*gs:(g+1)*gs])
    group_sizes      [L, Gm] neurons per group, 0 = padding (layer has fewer groups)
    group_impact     [L, Gm] sum of the group's frequencies (eq. 1 summed over the group)
    group_bytes      [L, Gm]
    min_gpu_neurons  [L] C_l of eq. 5; n_ff_l (whole layer or nothing) when no part is worth a sync
    attn_impact      [L, K] impact of each attention unit (0 x 0 shape when not placeable)
    attn_bytes       [L, K] weights + KV cache of each attention unit
    gpu_capacity     bytes the placeable units may take on the GPU (budget - what is fixed)
    cpu_capacity     bytes the placeable units may take on the CPU (None: unbounded)
    """

    costs: ModelCosts
    budget_bytes: int
    freqs: list[np.ndarray]
    order: list[np.ndarray]
    group_size: int
    group_sizes: np.ndarray
    group_impact: np.ndarray
    group_bytes: np.ndarray
    min_gpu_neurons: np.ndarray
    attention_placeable: bool
    attn_impact: np.ndarray
    attn_bytes: np.ndarray
    gpu_capacity: int
    cpu_capacity: int | None

    @property
    def n_groups(self) -> np.ndarray:
        """[L] real (non-padding) groups per layer: G_l of eq. 6."""
        return np.count_nonzero(self.group_sizes, axis=1)

    def objective_of(self, a: np.ndarray, h: np.ndarray) -> float:
        """eq. 2 for a selection: a [L, Gm] bool FFN groups, h [L, K] bool attention units."""
        value = float((self.group_impact * a).sum())
        return value + (float((self.attn_impact * h).sum()) if self.attention_placeable else 0.0)

    def to_placement(self, a: np.ndarray, h: np.ndarray, *, status: str, method: str,
                     seconds: float, enforce_communication: bool) -> Placement:
        """Expand group selections (a [L, Gm] bool, h [L, K] bool) into a Placement."""
        masks = []
        for layer, order in enumerate(self.order):
            mask = np.zeros(order.size, dtype=bool)  # [n_ff_l]
            groups_of_rank = np.arange(order.size) // self.group_size  # group of each sorted position
            mask[order] = a[layer, groups_of_rank]
            masks.append(mask)
        L, K = self.costs.n_layer, self.costs.n_kv_groups
        attention = h.astype(bool) if self.attention_placeable else np.ones((L, K), dtype=bool)
        c = tuple(int(x) for x in self.min_gpu_neurons) if enforce_communication else (0,) * L
        return Placement(gpu_neurons=masks, gpu_attention=attention, budget_bytes=self.budget_bytes,
                         objective=self.objective_of(a, h), status=status,
                         gpu_share=gpu_share(masks, self.freqs), method=method,
                         group_size=self.group_size, min_gpu_neurons=c, solve_seconds=seconds)


# --- building ---------------------------------------------------------------------------------
def activation_frequencies(counts: Sequence[np.ndarray], n_tokens: int, costs: ModelCosts) -> list[np.ndarray]:
    """[L][n_ff_l] counts / n_tokens, after checking the counts match the model."""
    if not isinstance(n_tokens, (int, np.integer)) or n_tokens <= 0:
        raise StatsError(f"n_tokens: expected a positive integer (tokens profiled), got {n_tokens!r}")
    if len(counts) != costs.n_layer:
        raise StatsError(f"activation stats: expected {costs.n_layer} layers, got {len(counts)}")
    freqs = []
    for layer, (c, n_ff) in enumerate(zip(counts, costs.n_ff)):
        c = np.asarray(c, dtype=np.float64)
        if c.shape != (n_ff,):
            raise StatsError(f"activation stats layer {layer}: expected shape ({n_ff},), got {c.shape}")
        if not np.all(np.isfinite(c)) or c.min(initial=0) < 0 or c.max(initial=0) > n_tokens:
            raise StatsError(f"activation stats layer {layer}: expected counts in [0, n_tokens={n_tokens}], "
                             f"got min {c.min()} max {c.max()}; is n_tokens the number of tokens profiled?")
        freqs.append(c / n_tokens)
    return freqs


def communication_threshold(freq: np.ndarray, neuron_bytes: int, host: HostProfile) -> int:
    """C_l of eq. 5: the fewest GPU neurons that make the GPU's share of layer l worth a sync.

    A neuron e costs the CPU f_e * M / B_dram seconds per token (M = neuron_bytes, B_dram = host
    DRAM read bandwidth, f_e its activation frequency). Moving the n hottest neurons of the layer
    to the GPU saves sum_{e<n} f_(e) * M / B_dram per token, and splitting the layer costs one
    CPU-GPU synchronisation T_sync. So

        C_l = min { n : sum_{e<n} f_(e) * M / B_dram >= T_sync },   f_(0) >= f_(1) >= ...

    (0 when T_sync = 0). When even all neurons do not reach T_sync, C_l = n_ff: the layer goes to
    the GPU whole or not at all, since a layer with no CPU neurons needs no sync (the paper's
    "never" would keep a small layer on the CPU at any budget: the planted-free tiny model at
    16 GiB was placed all on the CPU and decoded at 208 tok/s against 352 all on the GPU, dev
    machine). The GPU's own time for those neurons (M / B_hbm, ~4 % of the CPU's) is neglected,
    as in the paper.
    """
    need = host.sync_seconds * host.dram_gbs * 1e9 / neuron_bytes  # activation mass worth a sync
    if need <= 0:
        return 0
    mass = np.cumsum(np.sort(freq)[::-1])  # [n_ff] saving of the n hottest, in activations/token
    n = int(np.searchsorted(mass, need * (1 - 1e-12), side="left")) + 1
    return min(n, freq.size)


def _groups(freq: np.ndarray, group_size: int, n_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort one layer by frequency and cut it in groups: (order [F], sizes [n_max], impact [n_max])."""
    order = np.argsort(-freq, kind="stable")  # hottest first; ties keep neuron order
    n_groups = math.ceil(freq.size / group_size)
    padded = np.zeros(n_max * group_size)
    padded[: freq.size] = freq[order]
    impact = padded.reshape(n_max, group_size).sum(axis=1)
    sizes = np.zeros(n_max, dtype=np.int64)
    sizes[:n_groups] = group_size
    sizes[n_groups - 1] = freq.size - (n_groups - 1) * group_size
    return order, sizes, impact


def build_problem(
    counts: Sequence[np.ndarray],
    n_tokens: int,
    costs: ModelCosts,
    budget_bytes: int,
    host: HostProfile | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    attention_placeable: bool | None = None,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
) -> PlacementProblem:
    """Check the inputs and build the placeable units.

    counts: [L][n_ff_l] activation counts over n_tokens tokens. attention_placeable: None = only
    when all attention does not fit in the budget next to the fixed parts.
    """
    host = host or HostProfile()
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ValueError(f"group_size: expected a positive integer, got {group_size!r}")
    if attention_weight < 0:
        raise ValueError(f"attention_weight: expected >= 0, got {attention_weight}")
    budget_bytes = int(budget_bytes)
    freqs = activation_frequencies(counts, n_tokens, costs)
    if attention_placeable is None:
        attention_placeable = costs.fixed_bytes + costs.attention_bytes > budget_bytes
    gpu_capacity = budget_bytes - costs.min_budget_bytes(attention_placeable)
    if gpu_capacity < 0:
        raise InfeasibleBudgetError(_budget_message(costs, budget_bytes, attention_placeable),
                                    costs.min_budget_bytes(attention_placeable))

    n_max = max(math.ceil(f / group_size) for f in costs.n_ff)
    order, sizes, impact = zip(*(_groups(f, group_size, n_max) for f in freqs))
    group_sizes = np.stack(sizes)  # [L, Gm]
    group_bytes = group_sizes * np.asarray(costs.neuron_bytes, dtype=np.int64)[:, None]  # [L, Gm]
    c = np.array([communication_threshold(f, b, host) for f, b in zip(freqs, costs.neuron_bytes)])
    attn_impact, attn_bytes = _attention_units(costs, attention_placeable, attention_weight)
    cpu_capacity = _cpu_capacity(costs, host, attention_placeable, gpu_capacity)
    return PlacementProblem(costs=costs, budget_bytes=budget_bytes, freqs=freqs, order=list(order),
                            group_size=int(group_size), group_sizes=group_sizes,
                            group_impact=np.stack(impact), group_bytes=group_bytes,
                            min_gpu_neurons=c, attention_placeable=bool(attention_placeable),
                            attn_impact=attn_impact, attn_bytes=attn_bytes,
                            gpu_capacity=gpu_capacity, cpu_capacity=cpu_capacity)


def _attention_units(costs: ModelCosts, placeable: bool, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """(impact [L, K], bytes [L, K]) of the attention units; empty when attention is fixed."""
    if not placeable:
        return np.zeros((0, 0)), np.zeros((0, 0), dtype=np.int64)
    unit = np.asarray(costs.attn_unit_bytes, dtype=np.int64)  # [L]
    per_neuron = np.asarray(costs.neuron_bytes, dtype=np.float64)  # [L]
    impact = np.repeat((weight * unit / per_neuron)[:, None], costs.n_kv_groups, axis=1)
    return impact, np.repeat(unit[:, None], costs.n_kv_groups, axis=1)


def _cpu_capacity(costs: ModelCosts, host: HostProfile, placeable: bool, gpu_capacity: int) -> int | None:
    """Host RAM for the placeable units (eq. 4 on the CPU), after checking it can hold the rest."""
    if host.host_ram_bytes is None:
        return None
    units = costs.ffn_bytes + (costs.attention_bytes if placeable else 0)
    if units - gpu_capacity > host.host_ram_bytes:
        need = units - gpu_capacity
        raise InfeasibleBudgetError(
            f"host RAM: even with the GPU budget full, the CPU must hold {need} bytes "
            f"({need / GIB:.2f} GiB), expected <= host_ram_bytes {host.host_ram_bytes} "
            f"({host.host_ram_bytes / GIB:.2f} GiB); raise the VRAM budget or host_ram_bytes",
            min_budget_bytes=costs.min_budget_bytes(placeable) + need - host.host_ram_bytes)
    return host.host_ram_bytes


def _budget_message(costs: ModelCosts, budget: int, placeable: bool) -> str:
    need = costs.min_budget_bytes(placeable)
    what = ("all FFN neurons and attention groups on the CPU" if placeable else
            f"all attention + KV cache ({format_bytes(costs.attention_bytes)}) on the GPU, "
            f"all FFN neurons on the CPU")
    return (f"--vram-budget {budget / GIB:.3f} GiB ({budget} bytes) is too small: the minimum "
            f"budget that works is {need / GIB:.3f} GiB ({need} bytes) = {costs.describe_fixed()}"
            f" with {what}; raise the budget, or shrink the context/batch (KV cache) or predictors")
