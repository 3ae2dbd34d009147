"""The layer plan: which FFN neurons and which KV-head groups of each layer each executor holds.

A plan comes from a solved placement (``placement``), from a cached upstream split file, or from
the simple constructors here (all on the primary, all on the CPU, the hottest fraction on the
primary). ``primary`` is the GPU executor (or, on a host without GPU, the CPU primary);
``cpu`` is the CPU executor of cold neurons and CPU-placed heads.

A running engine changes its plan by ``Swap``s (``runtime.replacement``): pairs of neurons of one
layer trade places, the GPU's at a row of the primary's shard with the CPU's at a row of the CPU
shard, so every shard keeps its size and every other neuron its row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..model.config import ModelConfig


@dataclass(frozen=True)
class LayerPlan:
    # [Ng] int64 global neuron ids on the primary, in its shard's row order (ascending as loaded;
    # a ``Swap`` puts a neuron where the one it replaced was)
    gpu_neurons: np.ndarray
    # [Nc] int64, disjoint from gpu_neurons, in the CPU shard's row order: ascending ids, or
    # hottest first (``Plan.hot_first``); the CPU mask's bit j is row j
    cpu_neurons: np.ndarray
    gpu_groups: np.ndarray  # [Gg] int64 KV-head groups (with their query heads) on the primary
    cpu_groups: np.ndarray  # [Gc] int64

    @property
    def cpu_has_work(self) -> bool:
        return len(self.cpu_neurons) > 0 or len(self.cpu_groups) > 0


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerPlan, ...]
    # 'q8_0' | 'q4_0': the primary holds predictors a file stores in float as these blocks
    # (quantized at load; fewer bytes for neurons at a tight budget); None: as the file stores them
    predictor_qtype: str | None = None
    # the primary holds the token embedding in page-locked host memory, and a CUDA primary gathers
    # a step's rows over PCIe: its bytes hold hot neurons (set for a VRAM budget; an output head
    # tied to the embedding keeps it on the device)
    embd_on_host: bool = False

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, l: int) -> LayerPlan:
        return self.layers[l]

    @property
    def needs_cpu_executor(self) -> bool:
        return any(lp.cpu_has_work for lp in self.layers)

    @property
    def max_cpu_neurons(self) -> int:
        return max((len(lp.cpu_neurons) for lp in self.layers), default=0)

    def verify(self, cfg: ModelConfig) -> None:
        """Each neuron and each KV group of each layer lives on exactly one executor."""
        assert len(self.layers) == cfg.n_layer, f"plan has {len(self.layers)} layers, model {cfg.n_layer}"
        for l, lp in enumerate(self.layers):
            both = np.concatenate([lp.gpu_neurons, lp.cpu_neurons])
            assert np.array_equal(np.sort(both), np.arange(cfg.n_ff)), f"layer {l}: neurons not a partition"
            groups = np.concatenate([lp.gpu_groups, lp.cpu_groups])
            assert np.array_equal(np.sort(groups), np.arange(cfg.n_head_kv)), f"layer {l}: groups not a partition"

    # --- constructors -------------------------------------------------------------------------
    @classmethod
    def from_masks(cls, neuron_gpu: list[np.ndarray], group_gpu: list[np.ndarray] | None,
                   cfg: ModelConfig) -> "Plan":
        """From per-layer bool masks (True = on the primary)."""
        layers = []
        for l in range(cfg.n_layer):
            m = np.asarray(neuron_gpu[l], dtype=bool)
            g = np.ones(cfg.n_head_kv, bool) if group_gpu is None else np.asarray(group_gpu[l], dtype=bool)
            layers.append(LayerPlan(np.flatnonzero(m).astype(np.int64), np.flatnonzero(~m).astype(np.int64),
                                    np.flatnonzero(g).astype(np.int64), np.flatnonzero(~g).astype(np.int64)))
        plan = cls(tuple(layers))
        plan.verify(cfg)
        return plan

    @classmethod
    def all_gpu(cls, cfg: ModelConfig) -> "Plan":
        return cls.from_masks([np.ones(cfg.n_ff, bool)] * cfg.n_layer, None, cfg)

    @classmethod
    def all_cpu(cls, cfg: ModelConfig) -> "Plan":
        return cls.from_masks([np.zeros(cfg.n_ff, bool)] * cfg.n_layer,
                              [np.zeros(cfg.n_head_kv, bool)] * cfg.n_layer, cfg)

    @classmethod
    def whole_layers(cls, cfg: ModelConfig, k: int) -> "Plan":
        """Layers 0 .. k-1 whole on the primary (heads and every neuron), the rest on the CPU
        executor: llama.cpp's -ngl, the layer-offload baseline."""
        return cls.from_masks([np.full(cfg.n_ff, l < k) for l in range(cfg.n_layer)],
                              [np.full(cfg.n_head_kv, l < k) for l in range(cfg.n_layer)], cfg)

    @classmethod
    def hottest(cls, cfg: ModelConfig, gpu_fraction: float, counts: list[np.ndarray] | None = None,
                cpu_groups: int = 0) -> "Plan":
        """The ``gpu_fraction`` most active neurons of each layer on the primary (by ``counts``;
        the first ones when no statistics are given), and ``cpu_groups`` KV groups on the CPU."""
        masks = []
        k = int(round(gpu_fraction * cfg.n_ff))
        for l in range(cfg.n_layer):
            order = np.argsort(-counts[l], kind="stable") if counts is not None else np.arange(cfg.n_ff)
            m = np.zeros(cfg.n_ff, bool)
            m[order[:k]] = True
            masks.append(m)
        g = np.ones(cfg.n_head_kv, bool)
        g[cfg.n_head_kv - cpu_groups:] = False
        return cls.from_masks(masks, [g] * cfg.n_layer, cfg)

    def hot_first(self, counts: list[np.ndarray]) -> "Plan":
        """The same split with each layer's CPU neurons ordered by ``counts`` (most active first,
        ties by id): the rows a token activates then cluster at the front of the CPU shard
        instead of lying anywhere in it, which the CPU kernel reads at least as fast."""
        layers = []
        for l, lp in enumerate(self.layers):
            order = np.argsort(-np.asarray(counts[l])[lp.cpu_neurons], kind="stable")
            layers.append(LayerPlan(lp.gpu_neurons, lp.cpu_neurons[order], lp.gpu_groups, lp.cpu_groups))
        return replace(self, layers=tuple(layers))

    def placed(self) -> dict:
        """What the plan puts on the primary: its share of the FFN neurons and of the KV-head
        groups, layers with no primary neurons, and the predictors' type there."""
        n = [(len(lp.gpu_neurons), len(lp.gpu_neurons) + len(lp.cpu_neurons)) for lp in self.layers]
        g = [(len(lp.gpu_groups), len(lp.gpu_groups) + len(lp.cpu_groups)) for lp in self.layers]
        return {"gpu_neuron_share": sum(a for a, _ in n) / max(sum(b for _, b in n), 1),
                "gpu_group_share": sum(a for a, _ in g) / max(sum(b for _, b in g), 1),
                "layers_without_gpu_neurons": sum(a == 0 for a, _ in n),
                "predictor_qtype": self.predictor_qtype, "embd_on_host": self.embd_on_host}

    def swap(self, s: "Swap") -> "Plan":
        """This plan with the neuron pairs of ``s`` traded (see ``Swap``)."""
        lp = self.layers[s.l]
        assert np.array_equal(lp.gpu_neurons[s.gpu_rows], s.to_cpu) and np.array_equal(lp.cpu_neurons[s.cpu_rows], s.to_gpu), \
            f"layer {s.l}: the swap was made for another plan"
        gpu, cpu = lp.gpu_neurons.copy(), lp.cpu_neurons.copy()
        gpu[s.gpu_rows], cpu[s.cpu_rows] = s.to_gpu, s.to_cpu
        layers = list(self.layers)
        layers[s.l] = LayerPlan(gpu, cpu, lp.gpu_groups, lp.cpu_groups)
        return replace(self, layers=tuple(layers))

    def gpu_activation_share(self, counts: list[np.ndarray]) -> float:
        """Share of all activations that fall on the primary's neurons."""
        tot = sum(float(c.sum()) for c in counts)
        gpu = sum(float(counts[l][lp.gpu_neurons].sum()) for l, lp in enumerate(self.layers))
        return gpu / tot if tot else 0.0


@dataclass(frozen=True)
class Swap:
    """Neuron pairs of layer ``l`` that trade places: ``to_gpu[i]``, the CPU shard's neuron at its
    row ``cpu_rows[i]``, takes row ``gpu_rows[i]`` of the primary's shard, and ``to_cpu[i]``, the
    neuron there, takes its CPU row. The ids travel with the rows so that an executor whose plan
    is not the one the swap was made for fails at once (``Plan.swap``)."""

    l: int
    gpu_rows: np.ndarray  # [m] int64 rows of the primary's shard
    cpu_rows: np.ndarray  # [m] int64 rows of the CPU shard
    to_gpu: np.ndarray  # [m] int64 neuron ids (now on the CPU)
    to_cpu: np.ndarray  # [m] int64 neuron ids (now on the primary)

    @classmethod
    def of(cls, plan: Plan, l: int, gpu_rows: np.ndarray, cpu_rows: np.ndarray) -> "Swap":
        lp = plan[l]
        g, c = np.asarray(gpu_rows, np.int64), np.asarray(cpu_rows, np.int64)
        assert len(g) == len(c), f"layer {l}: {len(g)} GPU rows for {len(c)} CPU rows"
        return cls(l, g, c, lp.cpu_neurons[c].copy(), lp.gpu_neurons[g].copy())

    def __len__(self) -> int:
        return len(self.gpu_rows)
