"""ModelCosts: the byte sizes the placement solver needs, and nothing else about the model.

Callers build it from the model config (placement may not import powerinfer_ray.model), usually
with `ModelCosts.from_shape(...)`. All sizes are bytes at the storage dtype.

Legend: L n_layer, F n_ff (per layer), K n_kv_groups (= n_head_kv), D n_embd, hd head_dim.

What lives where (the solver's view of the GPU budget):
  fixed on the GPU   dense parts (embeddings, output head, norms), predictors, workspace
  placeable          FFN neurons (one neuron = its rows of up, gate, down_t)
  attention          q/k/v/o rows of the heads of one KV-head group + that group's KV cache;
                     on the GPU unless all of it does not fit, then placeable per (layer, group).
                     The KV cache of a group lives where the group is computed (the executor that
                     holds a head's q/k/v/o also holds its cache: DESIGN section 1).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

GIB = 1 << 30
NORM_BYTES = 4  # norms are stored f32 in GGUF
DEFAULT_N_UBATCH = 512  # prefill chunk the workspace estimate is sized for (llama.cpp's n_ubatch)


def format_bytes(n: float) -> str:
    """'12.345 GiB', or MiB below 0.1 GiB (tiny test models)."""
    return f"{n / GIB:.3f} GiB" if abs(n) >= 0.1 * GIB else f"{n / (1 << 20):.3f} MiB"


class CostsError(ValueError):
    """Model-shape input that cannot describe a model."""


def _per_layer(name: str, value: int | Sequence[int], n_layer: int) -> tuple[int, ...]:
    """Broadcast an int to n_layer entries, or check a sequence has n_layer entries."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (int(value),) * n_layer
    values = tuple(int(v) for v in value)
    if len(values) != n_layer:
        raise CostsError(f"{name}: expected {n_layer} entries (one per layer), got {len(values)}")
    return values


def _check_nonneg(name: str, values: Sequence[int], positive: bool = False) -> None:
    for i, v in enumerate(values):
        if v < 0 or (positive and v == 0):
            want = "a positive integer" if positive else "a non-negative integer"
            raise CostsError(f"{name}[{i}]: expected {want}, got {v}")


@dataclass(frozen=True)
class ModelCosts:
    """Byte costs of a model for the placement solver.

    n_layer          L
    n_ff             [L] FFN neurons per layer
    neuron_bytes     [L] bytes of one FFN neuron (rows of up + gate (if any) + down_t)
    n_kv_groups      K KV-head groups per layer (one group = one KV head and its query heads)
    attn_group_bytes [L] q/k/v/o bytes of the heads of one KV group
    kv_group_bytes   [L] KV-cache bytes of one group for the configured context x batch
    predictor_bytes  [L] bytes of the layer's predictor (fc1 + fc2); always on the GPU
    dense_bytes      embeddings, output head, norms; always on the GPU
    workspace_bytes  activation buffers, logits, scratch; always on the GPU
    """

    n_layer: int
    n_ff: tuple[int, ...]
    neuron_bytes: tuple[int, ...]
    n_kv_groups: int
    attn_group_bytes: tuple[int, ...]
    kv_group_bytes: tuple[int, ...]
    predictor_bytes: tuple[int, ...]
    dense_bytes: int
    workspace_bytes: int

    def __post_init__(self) -> None:
        if int(self.n_layer) <= 0:
            raise CostsError(f"n_layer: expected a positive integer, got {self.n_layer}")
        if int(self.n_kv_groups) <= 0:
            raise CostsError(f"n_kv_groups: expected a positive integer, got {self.n_kv_groups}")
        for name in ("n_ff", "neuron_bytes", "attn_group_bytes", "kv_group_bytes", "predictor_bytes"):
            values = _per_layer(name, getattr(self, name), int(self.n_layer))
            _check_nonneg(name, values, positive=name in ("n_ff", "neuron_bytes"))
            object.__setattr__(self, name, values)
        for name in ("dense_bytes", "workspace_bytes"):
            if int(getattr(self, name)) < 0:
                raise CostsError(f"{name}: expected a non-negative integer, got {getattr(self, name)}")
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "n_layer", int(self.n_layer))
        object.__setattr__(self, "n_kv_groups", int(self.n_kv_groups))

    # --- derived sizes ----------------------------------------------------------------------
    @property
    def attn_layer_bytes(self) -> tuple[int, ...]:
        """[L] q/k/v/o bytes of a whole layer (all KV groups), without the KV cache."""
        return tuple(self.n_kv_groups * a for a in self.attn_group_bytes)

    @property
    def attn_unit_bytes(self) -> tuple[int, ...]:
        """[L] GPU bytes one KV-head group takes where it lives: weights + its KV cache."""
        return tuple(a + k for a, k in zip(self.attn_group_bytes, self.kv_group_bytes))

    @property
    def attention_bytes(self) -> int:
        """Attention weights and KV cache of all layers and groups."""
        return self.n_kv_groups * sum(self.attn_unit_bytes)

    @property
    def ffn_bytes(self) -> int:
        """All FFN neurons of all layers."""
        return sum(f * b for f, b in zip(self.n_ff, self.neuron_bytes))

    @property
    def fixed_bytes(self) -> int:
        """What always sits on the GPU: dense parts + predictors + workspace."""
        return self.dense_bytes + sum(self.predictor_bytes) + self.workspace_bytes

    @property
    def total_bytes(self) -> int:
        """Everything: the budget at which the whole model fits on the GPU."""
        return self.fixed_bytes + self.attention_bytes + self.ffn_bytes

    def min_budget_bytes(self, attention_placeable: bool = True) -> int:
        """Smallest workable GPU budget: zero FFN neurons on the GPU, and zero attention groups
        when attention is placeable (else all attention and its KV cache)."""
        return self.fixed_bytes + (0 if attention_placeable else self.attention_bytes)

    def describe_fixed(self) -> str:
        """One line: the parts of fixed_bytes."""
        return (f"dense {format_bytes(self.dense_bytes)} + predictors "
                f"{format_bytes(sum(self.predictor_bytes))} + workspace {format_bytes(self.workspace_bytes)}")

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_shape(
        cls,
        n_layer: int,
        n_embd: int,
        n_ff: int | Sequence[int],
        n_head: int,
        n_head_kv: int,
        n_vocab: int,
        gated: bool,
        dtype_bytes: float,
        predictor_ranks: Sequence[int],
        n_ctx: int,
        batch: int,
        *,
        kv_dtype_bytes: float = 2.0,
        predictor_dtype_bytes: float | None = None,
        tied_embeddings: bool = False,
        bias: bool = False,
        workspace_bytes: int | None = None,
        n_ubatch: int = DEFAULT_N_UBATCH,
    ) -> "ModelCosts":
        """Costs of a transformer of the given shape.

        dtype_bytes may be fractional for block-quantised types (q4_0: 18/32); a row of D
        elements costs ceil(D * dtype_bytes). predictor_ranks: [L] widths r (0 = no predictor);
        a predictor is fc1 [D -> r] + fc2 [r -> F], stored at predictor_dtype_bytes (default:
        dtype_bytes, as the rest of the model). KV cache: K and V, hd each, n_ctx x batch
        tokens per group. Norms are counted as weight + bias at f32 (an upper bound: a few KB).
        workspace_bytes=None estimates fp32 buffers for one prefill chunk of n_ubatch tokens:
        hidden/residual (4 D), FFN outputs (2 F), logits (V), attention scores (n_head n_ctx).
        """
        ints = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                    n_vocab=n_vocab, n_ctx=n_ctx, batch=batch, n_ubatch=n_ubatch)
        for name, v in ints.items():
            if int(v) <= 0:
                raise CostsError(f"{name}: expected a positive integer, got {v}")
        if n_embd % n_head:
            raise CostsError(f"n_embd: expected a multiple of n_head={n_head}, got {n_embd}")
        if n_head % n_head_kv:
            raise CostsError(f"n_head_kv: expected a divisor of n_head={n_head}, got {n_head_kv}")
        if dtype_bytes <= 0:
            raise CostsError(f"dtype_bytes: expected > 0, got {dtype_bytes}")
        ff = _per_layer("n_ff", n_ff, n_layer)
        ranks = _per_layer("predictor_ranks", predictor_ranks, n_layer)
        _check_nonneg("predictor_ranks", ranks)

        hd, q_per_group = n_embd // n_head, n_head // n_head_kv
        row = math.ceil(n_embd * dtype_bytes)  # one row of D elements
        bias_el = math.ceil(dtype_bytes) if bias else 0  # one bias element (biases are not quantised)
        neuron = (3 if gated else 2) * row + (2 if gated else 1) * bias_el
        # q rows + o columns for q_per_group heads, k and v rows for the one KV head
        attn_group = (2 * q_per_group + 2) * hd * row + (q_per_group + 2) * hd * bias_el
        kv_group = math.ceil(2 * hd * n_ctx * batch * kv_dtype_bytes)
        pred_b = dtype_bytes if predictor_dtype_bytes is None else predictor_dtype_bytes
        predictor = [math.ceil((n_embd * r + r * f) * pred_b) for r, f in zip(ranks, ff)]
        embd = math.ceil(n_vocab * n_embd * dtype_bytes)
        norms = (2 * n_layer + 1) * 2 * n_embd * NORM_BYTES
        dense = embd * (1 if tied_embeddings else 2) + norms + 2 * n_layer * n_embd * bias_el
        if workspace_bytes is None:
            t = min(n_ubatch, n_ctx * batch)
            workspace_bytes = 4 * t * (4 * n_embd + 2 * max(ff) + n_vocab + n_head * n_ctx)
        return cls(n_layer=n_layer, n_ff=ff, neuron_bytes=(neuron,) * n_layer,
                   n_kv_groups=n_head_kv, attn_group_bytes=(attn_group,) * n_layer,
                   kv_group_bytes=(kv_group,) * n_layer, predictor_bytes=tuple(predictor),
                   dense_bytes=dense, workspace_bytes=int(workspace_bytes))

    # --- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "model costs") -> "ModelCosts":
        """From to_dict()'s fields, or {"shape": {...from_shape keyword arguments...}}."""
        if not isinstance(data, dict):
            raise CostsError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if "shape" in data:
            shape = data["shape"]
            if not isinstance(shape, dict):
                raise CostsError(f"{source}: 'shape' expected an object of from_shape arguments")
            try:
                return cls.from_shape(**shape)
            except TypeError as e:
                raise CostsError(f"{source}: bad 'shape' arguments for ModelCosts.from_shape: {e}") from e
        names = {f.name for f in fields(cls)}
        missing, unknown = names - data.keys(), data.keys() - names
        if missing or unknown:
            raise CostsError(f"{source}: expected the fields {sorted(names)} (or a 'shape' object); "
                             f"missing {sorted(missing)}, unknown {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelCosts":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CostsError(f"{path}: model-shape file not found") from None
        except json.JSONDecodeError as e:
            raise CostsError(f"{path}: expected JSON, got a parse error: {e}") from e
        return cls.from_dict(data, source=str(path))
