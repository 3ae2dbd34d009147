"""Placement files: upstream PowerInfer's split file, and our own.

Upstream split file `<model>.generated.gpuidx` (GGUF, architecture "generic.gpu_index"), as
powerinfer-py's export_split writes it and llama.cpp's load_gpu_idx_for_model reads it:
  tensors, for each layer l in order: blk.{l}.gpu_idx (int32 [n_ff], 1 = neuron on the GPU),
          then blk.{l}.gpu_bucket (int32, the sorted GPU neuron ids). Upstream reads them BY
          POSITION (2l, 2l+1) and checks n_tensors == 2 n_layer, so the order is the format.
  keys    split.vram_capacity (uint64): upstream loads the file only if this is <= the VRAM it
          has left for FFN neurons (`upstream_ffn_budget`); its own files hold that FFN budget, we
          store the bytes our GPU neurons take (upstream's own TODO: "better to save the actual
          capacity that split neurons require"), never less than upstream will load;
          generic.gpu_index.block_count (uint32): layers, as export_split's add_block_count.
          Ours, which upstream ignores: powerinfer_ray.split.vram_budget (uint64, the whole
          budget the split was solved for) and powerinfer_ray.split.gpu_attention (int32 0/1
          [L * K], the KV-head groups on the GPU, layer-major), so a cached split is our plan.
          Our files before these keys held the whole budget in split.vram_capacity:
          `capacity_meaning` tells the two apart.
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
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import gguf
import numpy as np

from .costs import ModelCosts
from .result import Placement, PlacementError, ffn_bytes_of

# --- split-file names (the one place they are spelled) ------------------------------------------
GPUIDX_SUFFIX = ".generated.gpuidx"  # <model file> + this
SPLIT_ARCH = "generic.gpu_index"  # general.architecture of the split file
GPU_IDX_TENSOR = "blk.{layer}.gpu_idx"  # int32 [n_ff] 0/1 mask; tensor 2l
GPU_BUCKET_TENSOR = "blk.{layer}.gpu_bucket"  # int32 [n_gpu] sorted GPU neuron ids; tensor 2l+1
VRAM_CAPACITY_KEY = "split.vram_capacity"  # uint64 bytes
BLOCK_COUNT_KEY = SPLIT_ARCH + ".block_count"  # uint32 layers
VRAM_BUDGET_KEY = "powerinfer_ray.split.vram_budget"  # uint64 bytes: the budget it was solved for (ours)
GPU_ATTENTION_KEY = "powerinfer_ray.split.gpu_attention"  # int32 0/1 [L * K], layer-major (ours)
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
    """Contents of a split file: per layer a bool GPU mask [n_ff], vram_capacity bytes, and our
    keys when the file has them: the budget it was solved for and the GPU's KV-head groups [L, K]."""

    gpu_neurons: list[np.ndarray]
    vram_capacity: int
    budget_bytes: int | None = None
    gpu_attention: np.ndarray | None = None
    magic: bytes = b"GGUF"

    def ffn_bytes(self, costs: ModelCosts) -> int:
        """Bytes of the FFN rows the masks put on the GPU (what upstream loads for them)."""
        return ffn_bytes_of(self.gpu_neurons, costs)

    def capacity_meaning(self, costs: ModelCosts) -> str:
        """What split.vram_capacity holds: "ffn", upstream's meaning (upstream's files, PWRI magic:
        the FFN budget it solved for; ours: the FFN bytes of the split), or "budget", the whole
        VRAM budget, as the engine wrote it beside a model before VRAM_BUDGET_KEY (the solve
        command wrote FFN bytes). A whole budget holds the dense parts (embeddings, output head,
        norms) beside the split's FFN rows; FFN bytes do not."""
        if self.budget_bytes is not None or self.magic == b"PWRI":
            return "ffn"
        return "budget" if self.vram_capacity >= self.ffn_bytes(costs) + costs.dense_bytes else "ffn"


# --- upstream split file ----------------------------------------------------------------------
def write_split(path: str | Path, placement: Placement, costs: ModelCosts) -> None:
    """Write a placement as a split file: its masks, vram_capacity = the FFN bytes they put on the
    GPU (upstream's meaning), and our keys (the budget, the attention groups)."""
    write_gpuidx(path, placement.gpu_neurons, placement.gpu_ffn_bytes(costs), placement.budget_bytes,
                 placement.gpu_attention)


def write_gpuidx(path: str | Path, gpu_neurons: Sequence[np.ndarray], vram_capacity: int,
                 budget_bytes: int | None = None, gpu_attention: np.ndarray | None = None) -> None:
    """Write masks [L][n_ff] (bool or 0/1) as upstream's split file, tensors in order 2l, 2l+1;
    budget_bytes and gpu_attention [L, K] as our keys when given."""
    writer = gguf.GGUFWriter(str(path), SPLIT_ARCH)
    writer.add_block_count(len(gpu_neurons))  # generic.gpu_index.block_count
    writer.add_uint64(VRAM_CAPACITY_KEY, int(vram_capacity))
    if budget_bytes is not None:
        writer.add_uint64(VRAM_BUDGET_KEY, int(budget_bytes))
    if gpu_attention is not None:
        groups = np.asarray(gpu_attention, dtype=bool)
        if groups.ndim != 2 or groups.shape[0] != len(gpu_neurons) or groups.shape[1] == 0:
            raise GpuIndexError(f"gpu_attention: expected a bool array [{len(gpu_neurons)}, K], got shape {groups.shape}")
        writer.add_array(GPU_ATTENTION_KEY, [int(g) for g in groups.reshape(-1)])
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
    with _open_gguf(path) as (reader, magic):
        index = _read_index(path, reader, n_ff)
    index.magic = magic
    return index


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
    return GpuIndex(gpu_neurons=masks, vram_capacity=int(_field_value(reader, VRAM_CAPACITY_KEY)),
                    budget_bytes=_field_value(reader, VRAM_BUDGET_KEY), gpu_attention=_read_groups(path, reader, n_layer))


def _read_groups(path: Path, reader: gguf.GGUFReader, n_layer: int) -> np.ndarray | None:
    """Our key GPU_ATTENTION_KEY as bool [L, K], None if absent."""
    field = reader.fields.get(GPU_ATTENTION_KEY)
    if field is None:
        return None
    flat = np.asarray(field.contents())
    if flat.size == 0 or flat.size % n_layer or not np.isin(flat, (0, 1)).all():
        raise GpuIndexError(f"{path}: {GPU_ATTENTION_KEY} expected 0/1 values, n_layer={n_layer} per KV-head group, "
                            f"got {flat.size} values {np.unique(flat)[:4]}")
    return flat.reshape(n_layer, -1).astype(bool)


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


# --- upstream's VRAM accounting ----------------------------------------------------------------
UPSTREAM_N_CTX = 512  # upstream main's default context (-c): its KV cache comes out of the budget
# llama.cpp's get_offloading_level, by tensor name: the levels it offloads, in the order it fills
# the budget, each tensor whole at its stored size; token and position embeddings stay on the
# CPU, FFN matrices go by the split file. (Placement may not import the model's gguf_keys.)
_UPSTREAM_LEVELS = (
    ("attention", re.compile(r"blk\.\d+\.(attn_norm|attn_norm_2|attn_q|attn_k|attn_v|attn_qkv|attn_output|"
                             r"attn_rot_embd|attn_q_norm|attn_k_norm)\.(weight|bias)")),
    ("predictors", re.compile(r"blk\.\d+\.(fc1|fc2)\.weight")),
    ("ffn_norm", re.compile(r"blk\.\d+\.ffn_norm\.(weight|bias)")),
    ("output", re.compile(r"(output|output_norm)\.(weight|bias)")),
)
_UPSTREAM_CPU = re.compile(r"(token_embd|token_embd_norm|position_embd|rope_freqs)(\.(weight|bias))?|"
                           r"blk\.\d+\.(ffn_up|ffn_gate|ffn_down|ffn_down_t)\.(weight|bias)")


def upstream_ffn_budget(tensor_bytes: Mapping[str, int], n_layer: int, n_embd_gqa: int, budget_bytes: int,
                        n_ctx: int = UPSTREAM_N_CTX) -> int | None:
    """The VRAM upstream PowerInfer leaves for FFN neurons of a model at a budget, which a split
    file's vram_capacity must not exceed (llama_gpu_split_loader::check_vram_allocable); None
    when the dense part does not fit, where upstream offloads no FFN neuron and reads no split.

    As llm_load_sparse_model_tensors counts: the budget (GiB * 2^30) less attention (norms, q/k/v
    or qkv, o), predictors, ffn_norm, output head and norm (every tensor not named by
    _UPSTREAM_CPU), then, when all of them fit, less the KV cache it reserves
    (llama_reserve_model_kv_cache: K, then V if it fits, each n_embd_gqa x n_layer x n_ctx f16).
    tensor_bytes: the model file's tensors, name -> stored bytes (ggml_nbytes)."""
    left = int(budget_bytes) - sum(_upstream_dense(tensor_bytes).values())
    if left < 0:
        return None
    kv = n_embd_gqa * n_layer * n_ctx * 2  # one of K, V in f16
    for _ in range(2):
        if left >= kv:
            left -= kv
    return left


def _upstream_dense(tensor_bytes: Mapping[str, int]) -> dict[str, int]:
    """Bytes upstream offloads before FFN neurons, per level of _UPSTREAM_LEVELS."""
    dense = {level: 0 for level, _ in _UPSTREAM_LEVELS}
    for name, n in tensor_bytes.items():
        level = next((lv for lv, pattern in _UPSTREAM_LEVELS if pattern.fullmatch(name)), None)
        if level is not None:
            dense[level] += int(n)
        elif not _UPSTREAM_CPU.fullmatch(name):
            raise GpuIndexError(f"tensor {name!r}: upstream's loader has no offloading level for it "
                                f"(expected attention, predictor, norm, output, embedding or FFN tensors)")
    return dense


@contextmanager
def _open_gguf(path: Path) -> Iterator[tuple[gguf.GGUFReader, bytes]]:
    """GGUFReader on path, and the file's magic; a PWRI-magic file is read through a copy with
    the GGUF magic."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise GpuIndexError(f"{path}: split file not found") from None
    if magic not in MAGICS:
        raise GpuIndexError(f"{path}: expected magic GGUF or PWRI, got {magic!r}")
    if magic == b"GGUF":
        yield _reader(path, path), magic
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        with open(copy, "r+b") as f:
            f.write(b"GGUF")
        yield _reader(copy, path), magic


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
