"""Activation statistics I/O: per layer, per neuron activation counts over n_tokens tokens.

Two forms (DESIGN section 1):
  Parquet   columns layer (int32), neuron (int32), count (int64); key/value metadata n_tokens
            (and, when we write it, n_ff: a JSON list of neurons per layer)
  .pt       upstream's activation/activation_{l}.pt, 1-D tensor of counts per layer. Loading
            needs torch, which placement may not import: the caller loads the files listed by
            activation_pt_files (torch.load(f, weights_only=True)) and passes numpy arrays.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .problem import StatsError

N_TOKENS_KEY = b"n_tokens"
N_FF_KEY = b"n_ff"
COLUMNS = ("layer", "neuron", "count")
PT_PATTERN = re.compile(r"activation_(\d+)\.pt")


@dataclass
class ActivationStats:
    """counts: [L][n_ff_l] activation counts (int64); n_tokens: tokens profiled."""

    counts: list[np.ndarray]
    n_tokens: int


def write_activation_parquet(path: str | Path, counts: Sequence[np.ndarray], n_tokens: int,
                             extra_metadata: dict[str, str] | None = None) -> None:
    """Write counts [L][n_ff_l] as one row per (layer, neuron); extra_metadata (e.g. the model
    name) goes into the key/value metadata beside n_tokens and n_ff."""
    layer = np.concatenate([np.full(len(c), l, dtype=np.int32) for l, c in enumerate(counts)])
    neuron = np.concatenate([np.arange(len(c), dtype=np.int32) for c in counts])
    count = np.concatenate([np.asarray(c, dtype=np.int64) for c in counts])
    meta = {N_TOKENS_KEY: str(int(n_tokens)).encode(), N_FF_KEY: json.dumps([len(c) for c in counts]).encode()}
    meta.update({k.encode(): v.encode() for k, v in (extra_metadata or {}).items()})
    table = pa.table({"layer": layer, "neuron": neuron, "count": count}).replace_schema_metadata(meta)
    pq.write_table(table, str(path))


def read_activation_parquet(path: str | Path, n_ff: Sequence[int] | None = None) -> ActivationStats:
    """Read counts from Parquet. n_ff [L]: neurons per layer (missing rows count 0); without it
    the file's n_ff metadata is used, else max(neuron) + 1 per layer."""
    path = Path(path)
    if not path.is_file():
        raise StatsError(f"{path}: activation statistics file not found")
    try:
        table = pq.read_table(str(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise StatsError(f"{path}: expected a Parquet file of activation counts, got: {e}") from e
    meta = table.schema.metadata or {}
    n_tokens = _n_tokens(path, meta)
    layer, neuron, count = _columns(path, table)
    shape = _layer_sizes(path, meta, layer, neuron, n_ff)
    counts = [np.zeros(f, dtype=np.int64) for f in shape]
    seen = [np.zeros(f, dtype=bool) for f in shape]
    for l in np.unique(layer):
        rows = layer == l
        ids = neuron[rows]
        if ids.min() < 0 or ids.max() >= shape[l]:
            raise StatsError(f"{path}: layer {l} neuron ids expected in [0, {shape[l]}), got "
                             f"[{ids.min()}, {ids.max()}]")
        if np.unique(ids).size != ids.size or seen[l][ids].any():
            raise StatsError(f"{path}: layer {l} lists a neuron more than once; expected one row "
                             f"per (layer, neuron)")
        counts[l][ids] = count[rows]
        seen[l][ids] = True
    return ActivationStats(counts=counts, n_tokens=n_tokens)


def _n_tokens(path: Path, meta: dict) -> int:
    raw = meta.get(N_TOKENS_KEY)
    if raw is None:
        raise StatsError(f"{path}: expected key/value metadata 'n_tokens' (tokens profiled), got "
                         f"keys {sorted(k.decode(errors='replace') for k in meta)}")
    try:
        value = int(raw.decode())
    except ValueError:
        raise StatsError(f"{path}: metadata n_tokens expected an integer, got {raw!r}") from None
    if value <= 0:
        raise StatsError(f"{path}: metadata n_tokens expected > 0, got {value}")
    return value


def _columns(path: Path, table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise StatsError(f"{path}: expected columns {list(COLUMNS)}, missing {missing} "
                         f"(has {table.column_names})")
    cols = []
    for name in COLUMNS:
        col = table.column(name)
        if not pa.types.is_integer(col.type) or col.null_count:
            raise StatsError(f"{path}: column {name} expected integers without nulls, got "
                             f"{col.type} with {col.null_count} nulls")
        cols.append(col.to_numpy().astype(np.int64))
    layer, neuron, count = cols
    if count.size and count.min() < 0:
        raise StatsError(f"{path}: column count expected >= 0, got min {count.min()}")
    if layer.size and layer.min() < 0:
        raise StatsError(f"{path}: column layer expected >= 0, got min {layer.min()}")
    return layer, neuron, count


def _layer_sizes(path: Path, meta: dict, layer: np.ndarray, neuron: np.ndarray,
                 n_ff: Sequence[int] | None) -> list[int]:
    """[L] neurons per layer: given, from metadata, or inferred from the rows."""
    if n_ff is None and N_FF_KEY in meta:
        n_ff = json.loads(meta[N_FF_KEY].decode())
    if n_ff is None:
        if layer.size == 0:
            raise StatsError(f"{path}: no rows and no n_ff: cannot tell the model's shape")
        n_layer = int(layer.max()) + 1
        return [int(neuron[layer == l].max(initial=-1)) + 1 for l in range(n_layer)]
    n_ff = [int(f) for f in n_ff]
    if layer.size and layer.max() >= len(n_ff):
        raise StatsError(f"{path}: layer ids expected < n_layer={len(n_ff)}, got {layer.max()}")
    return n_ff


def activation_pt_files(directory: str | Path) -> list[Path]:
    """Upstream's activation_{l}.pt files of a directory, in layer order (numeric, not lexical:
    upstream sorts lexically, putting activation_10 before activation_2). Checks 0..L-1."""
    directory = Path(directory)
    if not directory.is_dir():
        raise StatsError(f"{directory}: expected a directory of activation_{{l}}.pt files")
    found = {int(m.group(1)): directory / m.group(0)
             for m in (PT_PATTERN.fullmatch(p.name) for p in directory.iterdir()) if m}
    if not found:
        raise StatsError(f"{directory}: no activation_{{l}}.pt files")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise StatsError(f"{directory}: expected activation_0.pt .. activation_{max(found)}.pt, "
                         f"missing layers {missing}")
    return [found[l] for l in sorted(found)]
