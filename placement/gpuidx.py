"""Placement files: upstream PowerInfer's split file, and our own.

Upstream split file `<model>.generated.gpuidx` (GGUF, architecture "generic.gpu_index"), as
powerinfer-py's export_split writes it and llama.cpp's load_gpu_idx_for_model reads it:
  tensors, for each layer l in order: blk.{l}.gpu_idx (int32 [n_ff], 1 = neuron on the GPU),
          then blk.{l}.gpu_bucket (int32, the sorted GPU neuron ids). Upstream reads them BY
          POSITION (2l, 2l+1) and checks n_tensors == 2 n_layer, so the order is the format.
  keys    split.vram_capacity (uint64): upstream loads the file only if this is <= its VRAM budget
          for FFN neurons, so we store the bytes our GPU neurons take (upstream's own TODO:
          "better to save the actual capacity that split neurons require");
          generic.gpu_index.block_count (uint32): layers, as export_split's add_block_count.
Upstream overwrites the magic with "PWRI"; its loader accepts "GGUF" and "PWRI" alike, so we
write plain GGUF and read both. Upstream's ggml predates the IQ quant types: its I32 is type id
18 (which gguf-py today calls IQ3_XXS, writing I32 as 26). Upstream's files carry 18: we write
18 and read 18 and 26.

These names belong to this file format only; placement may not import powerinfer_ray.model
(where gguf_keys.py holds the model file's names), so they are the constants below, and no other
module spells them.

Our placement file (.npz) keeps what the split file cannot: attention groups, budget, objective,
grouping, status, the enforced C_l.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import gguf
import numpy as np

from .result import Placement, PlacementError

# --- split-file names (the one place they are spelled) ------------------------------------------
GPUIDX_SUFFIX = ".generated.gpuidx"  # <model file> + this
SPLIT_ARCH = "generic.gpu_index"  # general.architecture of the split file
GPU_IDX_TENSOR = "blk.{layer}.gpu_idx"  # int32 [n_ff] 0/1 mask; tensor 2l
GPU_BUCKET_TENSOR = "blk.{layer}.gpu_bucket"  # int32 [n_gpu] sorted GPU neuron ids; tensor 2l+1
VRAM_CAPACITY_KEY = "split.vram_capacity"  # uint64 bytes
BLOCK_COUNT_KEY = SPLIT_ARCH + ".block_count"  # uint32 layers
ARCH_KEY = "general.architecture"
MAGICS = (b"GGUF", b"PWRI")
UPSTREAM_I32 = gguf.GGMLQuantizationType(18)  # upstream ggml's GGML_TYPE_I32 (gguf-py: IQ3_XXS)

PLACEMENT_FORMAT = "powerinfer-ray.placement"
PLACEMENT_VERSION = 1


class GpuIndexError(ValueError):
    """A split or placement file that cannot be read as one."""


def gpuidx_path(model_path: str | Path) -> Path:
    """The split file upstream looks for next to a model: <model>.generated.gpuidx."""
    return Path(str(model_path) + GPUIDX_SUFFIX)


@dataclass
class GpuIndex:
    """Contents of a split file: per layer a bool GPU mask [n_ff], and vram_capacity bytes."""

    gpu_neurons: list[np.ndarray]
    vram_capacity: int


# --- upstream split file ----------------------------------------------------------------------
def write_gpuidx(path: str | Path, gpu_neurons: Sequence[np.ndarray], vram_capacity: int) -> None:
    """Write masks [L][n_ff] (bool or 0/1) as upstream's split file, tensors in order 2l, 2l+1."""
    writer = gguf.GGUFWriter(str(path), SPLIT_ARCH)
    writer.add_block_count(len(gpu_neurons))  # generic.gpu_index.block_count
    writer.add_uint64(VRAM_CAPACITY_KEY, int(vram_capacity))
    for layer, mask in enumerate(gpu_neurons):
        mask = np.asarray(mask)
        if mask.ndim != 1 or not np.isin(mask, (0, 1)).all():
            raise GpuIndexError(f"gpu_neurons[{layer}]: expected a 1-D 0/1 mask, got shape "
                                f"{mask.shape} with values {np.unique(mask)[:4]}")
        writer.add_tensor(GPU_IDX_TENSOR.format(layer=layer), mask.astype(np.int32),  # tensor 2l
                          raw_dtype=UPSTREAM_I32)
        bucket = np.flatnonzero(mask).astype(np.int32)  # sorted ids
        writer.add_tensor(GPU_BUCKET_TENSOR.format(layer=layer), bucket, raw_dtype=UPSTREAM_I32)  # tensor 2l+1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_gpuidx(path: str | Path, n_ff: Sequence[int] | None = None) -> GpuIndex:
    """Read a split file (GGUF or PWRI magic); check positions, names, lengths, bucket == mask.
    n_ff [L]: the model's neurons per layer, checked when given."""
    path = Path(path)
    with _open_gguf(path) as reader:
        return _read_index(path, reader, n_ff)


def _read_index(path: Path, reader: gguf.GGUFReader, n_ff: Sequence[int] | None) -> GpuIndex:
    fields = reader.fields
    arch = _field_value(reader, ARCH_KEY)
    if arch is not None and arch != SPLIT_ARCH:
        raise GpuIndexError(f"{path}: {ARCH_KEY} expected {SPLIT_ARCH!r}, got {arch!r}")
    if VRAM_CAPACITY_KEY not in fields:
        raise GpuIndexError(f"{path}: expected key {VRAM_CAPACITY_KEY}, got keys {sorted(fields)}")
    tensors = reader.tensors
    if len(tensors) % 2:
        raise GpuIndexError(f"{path}: expected 2 tensors per layer (gpu_idx, gpu_bucket), got {len(tensors)}")
    n_layer = len(tensors) // 2
    block_count = _field_value(reader, BLOCK_COUNT_KEY)
    if block_count is not None and block_count != n_layer:
        raise GpuIndexError(f"{path}: {BLOCK_COUNT_KEY} = {block_count}, expected {n_layer} (tensors / 2)")
    if n_ff is not None and len(n_ff) != n_layer:
        raise GpuIndexError(f"{path}: expected {len(n_ff)} layers for this model, got {n_layer}; "
                            f"regenerate it (--reset-gpu-index)")
    masks = [_read_layer(path, tensors, l, None if n_ff is None else int(n_ff[l])) for l in range(n_layer)]
    return GpuIndex(gpu_neurons=masks, vram_capacity=int(_field_value(reader, VRAM_CAPACITY_KEY)))


def _read_layer(path: Path, tensors: list, layer: int, n_ff: int | None) -> np.ndarray:
    idx, bucket = tensors[2 * layer], tensors[2 * layer + 1]  # upstream reads by position
    for t, name in ((idx, GPU_IDX_TENSOR), (bucket, GPU_BUCKET_TENSOR)):
        want = name.format(layer=layer)
        if t.name != want:
            raise GpuIndexError(f"{path}: tensor at position {tensors.index(t)} expected {want!r}, got {t.name!r}")
        if t.tensor_type != gguf.GGMLQuantizationType.I32:
            raise GpuIndexError(f"{path}: {want} expected type I32, got {t.tensor_type.name}")
    mask = np.asarray(idx.data).reshape(-1)
    if n_ff is not None and mask.size != n_ff:
        raise GpuIndexError(f"{path}: {idx.name} expected length n_ff={n_ff}, got {mask.size}")
    if not np.isin(mask, (0, 1)).all():
        raise GpuIndexError(f"{path}: {idx.name} expected 0/1 values, got {np.unique(mask)[:6]}")
    ids = np.asarray(bucket.data).reshape(-1)
    if not np.array_equal(ids, np.flatnonzero(mask)):
        raise GpuIndexError(f"{path}: {bucket.name} expected the sorted ids of {idx.name}'s ones "
                            f"({int(mask.sum())} ids), got {ids.size} ids that differ")
    return mask.astype(bool)


@contextmanager
def _open_gguf(path: Path) -> Iterator[gguf.GGUFReader]:
    """GGUFReader on path; a PWRI-magic file is read through a copy with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise GpuIndexError(f"{path}: split file not found") from None
    if magic not in MAGICS:
        raise GpuIndexError(f"{path}: expected magic GGUF or PWRI, got {magic!r}")
    if magic == b"GGUF":
        yield _reader(path, path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        with open(copy, "r+b") as f:
            f.write(b"GGUF")
        yield _reader(copy, path)


class _SplitReader(gguf.GGUFReader):
    """gguf's reader, reading tensor type id 18 as upstream's I32."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for f in fields:  # parts: name length, name, n_dims, dims, type, offset
            if int(f.parts[4][0]) == UPSTREAM_I32:
                f.parts[4] = np.array([gguf.GGMLQuantizationType.I32], dtype=np.uint32)
        super()._build_tensors(start_offs, fields)


def _reader(real: Path, shown: Path) -> gguf.GGUFReader:
    try:
        return _SplitReader(str(real))
    except (ValueError, IndexError, OSError) as e:
        raise GpuIndexError(f"{shown}: cannot read as GGUF: {e}") from e


def _field_value(reader: gguf.GGUFReader, key: str):
    """Scalar or string value of a key, None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode()
    return part.tolist()[0]


# --- our placement file -----------------------------------------------------------------------
def save_placement(path: str | Path, placement: Placement) -> None:
    """Write a Placement as .npz: masks, attention groups and a JSON header of the scalars."""
    meta = dict(format=PLACEMENT_FORMAT, version=PLACEMENT_VERSION, budget_bytes=int(placement.budget_bytes),
                objective=float(placement.objective), status=placement.status,
                gpu_share=float(placement.gpu_share), method=placement.method,
                group_size=int(placement.group_size), solve_seconds=float(placement.solve_seconds))
    with open(path, "wb") as f:  # a file object: np.savez would append .npz to a path
        np.savez_compressed(
            f, meta=np.array(json.dumps(meta)),
            n_ff=np.array([m.size for m in placement.gpu_neurons], dtype=np.int64),
            gpu_neurons=np.concatenate([np.asarray(m, dtype=bool) for m in placement.gpu_neurons]),
            gpu_attention=np.asarray(placement.gpu_attention, dtype=bool),
            min_gpu_neurons=np.asarray(placement.min_gpu_neurons, dtype=np.int64))


def load_placement(path: str | Path) -> Placement:
    """Read save_placement's file, checking its format, version and array lengths."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise GpuIndexError(f"{path}: placement file not found") from None
    except (ValueError, OSError) as e:
        raise GpuIndexError(f"{path}: expected a placement .npz, got: {e}") from e
    missing = {"meta", "n_ff", "gpu_neurons", "gpu_attention", "min_gpu_neurons"} - arrays.keys()
    if missing:
        raise GpuIndexError(f"{path}: expected a placement .npz, missing arrays {sorted(missing)}")
    meta = json.loads(str(arrays["meta"]))
    if meta.get("format") != PLACEMENT_FORMAT or meta.get("version") != PLACEMENT_VERSION:
        raise GpuIndexError(f"{path}: expected format {PLACEMENT_FORMAT} v{PLACEMENT_VERSION}, got "
                            f"{meta.get('format')!r} v{meta.get('version')!r}")
    n_ff, flat = arrays["n_ff"], arrays["gpu_neurons"]
    if flat.size != n_ff.sum():
        raise GpuIndexError(f"{path}: gpu_neurons expected {n_ff.sum()} entries (sum of n_ff), got {flat.size}")
    masks = np.split(flat.astype(bool), np.cumsum(n_ff)[:-1])
    return Placement(gpu_neurons=masks, gpu_attention=arrays["gpu_attention"].astype(bool),
                     budget_bytes=meta["budget_bytes"], objective=meta["objective"], status=meta["status"],
                     gpu_share=meta["gpu_share"], method=meta["method"], group_size=meta["group_size"],
                     min_gpu_neurons=tuple(int(c) for c in arrays["min_gpu_neurons"]),
                     solve_seconds=meta["solve_seconds"])


def placement_from_gpuidx(index: GpuIndex, n_kv_groups: int, budget_bytes: int) -> Placement:
    """A Placement from an upstream split file (attention all on the GPU, as upstream assumes)."""
    if n_kv_groups <= 0:
        raise PlacementError(f"n_kv_groups: expected > 0, got {n_kv_groups}")
    L = len(index.gpu_neurons)
    return Placement(gpu_neurons=index.gpu_neurons, gpu_attention=np.ones((L, n_kv_groups), dtype=bool),
                     budget_bytes=int(budget_bytes), objective=float("nan"), status="gpuidx",
                     gpu_share=float("nan"), method="gpuidx", group_size=1, min_gpu_neurons=(0,) * L)
