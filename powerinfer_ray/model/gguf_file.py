"""GGUF model files: a memory-mapped, lazy reader.

The reader accepts standard GGUF and upstream PowerInfer files (magic ``PWRI``); tensors stay on
disk until a caller asks for them, and a caller can ask for a subset of rows, so an executor
loads only its neuron rows and attention heads. Writing lives in ``gguf_writer``, metadata <->
``ModelConfig`` in ``gguf_config``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from gguf import GGUFReader
from gguf.constants import GGUF_MAGIC as _GGUF_MAGIC_U32

from . import gguf_keys as K
from .gguf_config import SUPPORTED_TYPES, ModelFileError, check_tensors, config_from_fields

_PWRI_U32 = int.from_bytes(K.PWRI_MAGIC, "little")


class _Reader(GGUFReader):
    """gguf's reader, taught to accept upstream PowerInfer's ``PWRI`` magic."""

    def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001
        arr = super()._get(offset, dtype, count, override_order)
        if offset == 0 and count == 1 and len(arr) and int(arr[0]) == _PWRI_U32:
            return np.array([_GGUF_MAGIC_U32], dtype=arr.dtype)
        return arr


class ModelFile:
    """A GGUF model on disk: metadata, ``ModelConfig`` and lazy tensor access.

    ``get(name, rows)`` copies only the requested rows out of the memory map.
    """

    def __init__(self, path: str | os.PathLike[str], validate: bool = True) -> None:
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.magic = self.path.open("rb").read(4)
        self.fields: dict[str, Any] = {
            f.name: f.contents() for f in self.reader.fields.values() if not f.name.startswith("GGUF.")
        }
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.tensors.values():
            if t.tensor_type not in SUPPORTED_TYPES:
                raise self.error(f"tensor {t.name!r} has type {t.tensor_type.name}; supported types "
                                 "are F32, F16, BF16 (quantized models are not supported yet: "
                                 "convert from the HF checkpoint with --outtype f16)")
        self.config = config_from_fields(self.fields, self.tensors, self.is_sparse, self.path)
        if validate:
            check_tensors(self.config, {n: self.raw(n).shape for n in self.tensors}, self.path)

    # --- metadata ---------------------------------------------------------------------------
    @property
    def is_sparse(self) -> bool:
        return self.magic == K.PWRI_MAGIC or any(n.endswith("fc1.weight") for n in self.tensors)

    def meta(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def error(self, msg: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {msg}")

    # --- tensors -----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor as a numpy memory-map view (bf16 shows as uint16); no copy."""
        if name not in self.tensors:
            raise self.error(f"missing tensor {name!r}")
        data = self.tensors[name].data
        return data.view(np.uint16) if data.dtype == np.uint8 else data  # gguf shows BF16 as bytes

    def dtype_of(self, name: str) -> str:
        return SUPPORTED_TYPES[self.tensors[name].tensor_type][0]

    def get(self, name: str, rows: Sequence[int] | np.ndarray | torch.Tensor | None = None,
            dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows ``rows`` (all when None) of tensor ``name`` as a torch tensor (a copy)."""
        arr = self.raw(name)
        arr = np.array(arr) if rows is None else arr[np.asarray(rows, dtype=np.int64)]  # a copy
        return _to_torch(arr, self.dtype_of(name), dtype, device)

    def layer(self, template: str, bid: int, rows: Any = None, dtype: torch.dtype | None = None,
              bias: bool = False, device: str | torch.device = "cpu") -> torch.Tensor:
        """A per-layer tensor by its template in ``gguf_keys`` (rows of it when given).

        Falls back to the layouts of other writers: ``ffn_down_t`` from a standard
        ``ffn_down`` [D, F], and q/k/v from a fused ``attn_qkv`` [(H + 2G) hd, D].
        """
        name = K.tensor(template, bid, bias)
        if name in self.tensors:
            return self.get(name, rows, dtype, device)
        if template == K.FFN_DOWN_T and not bias:
            down = self.raw(K.tensor(K.FFN_DOWN, bid))  # [D, F]
            cols = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
            arr = np.ascontiguousarray(down[:, cols].T)
            return _to_torch(arr, self.dtype_of(K.tensor(K.FFN_DOWN, bid)), dtype, device)
        if template in (K.ATTN_Q, K.ATTN_K, K.ATTN_V):
            fused = K.tensor(K.ATTN_QKV, bid, bias)
            if fused in self.tensors:
                base = self._qkv_rows(template)
                sel = base if rows is None else base[np.asarray(rows, dtype=np.int64)]
                return self.get(fused, sel, dtype, device)
        raise self.error(f"missing tensor {name!r}")

    def _qkv_rows(self, template: str) -> np.ndarray:
        c = self.config
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        start = {K.ATTN_Q: 0, K.ATTN_K: q, K.ATTN_V: q + kv}[template]
        return np.arange(start, start + (q if template == K.ATTN_Q else kv))

    def global_(self, name: str, dtype: torch.dtype | None = None, bias: bool = False) -> torch.Tensor:
        return self.get(K.global_tensor(name, bias), dtype=dtype)

    def output_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output head [V, D] (the token embedding when tied)."""
        name = K.OUTPUT if self.has(K.global_tensor(K.OUTPUT)) else K.TOKEN_EMBD
        return self.global_(name, dtype)


def open_gguf(path: Path) -> GGUFReader:
    """Open any GGUF/PWRI file, turning the gguf package's errors into one clear message."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic not in (K.GGUF_MAGIC, K.PWRI_MAGIC):
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF' or b'PWRI')")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, TypeError, OverflowError, MemoryError) as exc:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF header ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ModelFileError(f"{path}: truncated: tensor {t.name!r} needs bytes up to {end}, "
                                 f"the file has {size}")
    return reader


def _to_torch(arr: np.ndarray, kind: str, dtype: torch.dtype | None, device: Any) -> torch.Tensor:
    t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if kind == "bf16" else torch.from_numpy(arr)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device) if str(device) != "cpu" else t

