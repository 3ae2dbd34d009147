"""Writing GGUF model files: a streaming writer over gguf's GGUFWriter.

The writer stamps ``PWRI`` on sparse models (models with predictors) unless told not to, and
streams tensors one by one, so a model larger than RAM can be written from a generator.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.gguf_writer import GGUFValue

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_config import ModelFileError, check_tensors, config_to_fields
from .qtypes import GGML_TYPES, QuantError, row_bytes, storage_kind, tensor_bytes
from .quants import quantize


@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced only when the writer reaches it (for models larger than RAM)."""

    shape: tuple[int, ...]
    dtype: str  # storage: f32 | f16 | bf16 | i32 | q8_0 | q4_0 (| q6_k, given as blocks)
    make: Callable[[], np.ndarray | torch.Tensor]  # weights, or for block types uint8 blocks as they are


TensorLike = np.ndarray | torch.Tensor | LazyTensor

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32}


def write_model(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, TensorLike],
                metadata: Mapping[str, Any] | None = None, sparse: bool | None = None,
                validate: bool = True, progress: bool = False) -> Path:
    """Write a model file. Tensors are stored as ``quants.storage_kind`` says (matrices at
    ``cfg.dtype``, quantized when it is a block type; 1-D tensors at F32) unless lazy ones say.

    ``sparse`` (default: the model has predictors) stamps upstream PowerInfer's ``PWRI`` magic.
    Tensors are written in the order given; lazy ones are produced one at a time.
    """
    path = Path(path)
    if validate:
        check_tensors(cfg, {n: tuple(_shape(t)) for n, t in tensors.items()}, path)
    fields = config_to_fields(cfg)
    fields.update(metadata or {})
    write_gguf(path, cfg.arch, fields, ((n, t, _storage_dtype(cfg, n, t)) for n, t in tensors.items()),
               progress=progress)
    if sparse if sparse is not None else cfg.has_predictors:
        with path.open("r+b") as fh:
            fh.write(K.PWRI_MAGIC)
    return path


def fuse_qkv(cfg: ModelConfig, tensors: Mapping[str, TensorLike]) -> dict[str, TensorLike]:
    """``tensors`` with each layer's q, k and v written as one ``attn_qkv`` [(H + 2G) hd, D] in
    q's place, as llama.cpp's Falcon files hold them (readers split it: ``ModelFile.layer``);
    lazy tensors stay lazy, block rows concatenate as rows do."""
    out: dict[str, TensorLike] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in ("attn_q", "attn_k", "attn_v"):
            out[name] = t
        elif parts[2] == "attn_q":
            l, bias = int(parts[1]), parts[3] == "bias"
            qkv = [tensors[K.tensor(tmpl, l, bias)] for tmpl in (K.ATTN_Q, K.ATTN_K, K.ATTN_V)]
            out[K.tensor(K.ATTN_QKV, l, bias)] = _cat_rows(qkv)
    return out


def _cat_rows(parts: list[TensorLike]) -> TensorLike:
    """Rows of ``parts`` one after the other (lazily when they are lazy)."""
    if not all(isinstance(p, LazyTensor) for p in parts):
        return torch.cat([torch.as_tensor(p) for p in parts])
    kinds = {p.dtype for p in parts}
    assert len(kinds) == 1, f"q, k and v stored as {sorted(kinds)}: one fused tensor needs one type"
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return LazyTensor(shape, parts[0].dtype, lambda: torch.cat([torch.as_tensor(p.make()) for p in parts]))


def write_gguf(path: Path, arch: str, fields: Mapping[str, Any],
               tensors: Iterable[tuple[str, TensorLike, str]], progress: bool = False) -> None:
    """Write metadata and (name, tensor, storage dtype) triples with gguf's GGUFWriter; block
    types are quantized here (or written as given when the tensor is uint8 blocks)."""
    items = list(tensors)
    w = GGUFWriter(path, arch)
    for k, v in fields.items():
        _add_field(w, k, v)
    for name, t, kind in items:
        shape = tuple(_shape(t))
        try:
            nbytes = tensor_bytes(kind, shape)
        except QuantError as exc:
            raise ModelFileError(f"{path}: tensor {name!r} {list(shape)}: {exc}") from None
        # a non-uint8 dtype keeps GGUFWriter from reading the shape as bytes
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=GGML_TYPES[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _progress(progress, sum(int(np.prod(_shape(t))) for _, t, _ in items), f"writing {path.name}")
    for name, t, kind in items:
        arr = _to_numpy(t.make() if isinstance(t, LazyTensor) else t, kind)
        want = _stored_shape(kind, tuple(_shape(t)))
        if tuple(arr.shape) != want:
            raise ModelFileError(f"{path}: tensor {name!r} produced shape {list(arr.shape)}, "
                                 f"declared {list(want)} ({kind})")
        w.write_tensor_data(arr)
        if bar is not None:
            bar.update(int(np.prod(_shape(t))))
    w.close()
    if bar is not None:
        bar.close()


def _progress(enabled: bool, total: int, desc: str):  # noqa: ANN202
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="param", unit_scale=True)


def _shape(t: TensorLike) -> tuple[int, ...]:
    return tuple(t.shape)


def _storage_dtype(cfg: ModelConfig, name: str, t: TensorLike) -> str:
    if isinstance(t, LazyTensor):
        return t.dtype
    if t.dtype in (np.int32, torch.int32):
        return "i32"
    return storage_kind(cfg.dtype, name, tuple(t.shape))


def _stored_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy shape of what is written: weights, or [rows, row bytes] for block types."""
    return shape if kind in TORCH_DTYPES else (*shape[:-1], row_bytes(kind, shape[-1]))


def _to_numpy(t: np.ndarray | torch.Tensor, kind: str) -> np.ndarray:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    t = t.detach().cpu().contiguous()
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if kind in TORCH_DTYPES:
        return t.to(TORCH_DTYPES[kind]).numpy()
    if t.dtype == torch.uint8:  # blocks as they are
        return t.numpy()
    out = np.empty(_stored_shape(kind, tuple(t.shape)), np.uint8)
    step = max(1, (1 << 22) // t.shape[-1])  # quantize a few million weights at a time
    for i in range(0, t.shape[0], step):
        out[i: i + step] = quantize(t[i: i + step], kind).numpy()
    return out


def _add_field(w: GGUFWriter, key: str, v: Any) -> None:
    if key == K.ARCH:
        return  # GGUFWriter writes it from its arch argument
    if isinstance(v, GGUFValue):  # typed as another file had it (copied metadata)
        w.add_key_value(key, v.value, v.type, v.sub_type)
    elif isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, (int, np.integer)):
        v = int(v)
        w.add_uint32(key, v) if 0 <= v < 2**32 else w.add_int64(key, v)
    elif isinstance(v, (float, np.floating)):
        w.add_float32(key, float(v))
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, (list, tuple, np.ndarray)):
        w.add_array(key, list(v.tolist() if isinstance(v, np.ndarray) else v))
    else:
        raise TypeError(f"metadata {key!r}: cannot store a {type(v).__name__} in GGUF")
