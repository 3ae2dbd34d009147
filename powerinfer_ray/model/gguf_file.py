"""GGUF model files: a memory-mapped, lazy reader.

The reader accepts standard GGUF and upstream PowerInfer files (magic ``PWRI``); tensors stay on
disk until a caller asks for them, and a caller can ask for a subset of rows, so an executor
loads only its neuron rows and attention heads. Writing lives in ``gguf_writer``, metadata <->
``ModelConfig`` in ``gguf_config``.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGUF_MAGIC as _GGUF_MAGIC_U32

from . import gguf_keys as K
from .gguf_config import ModelFileError, check_tensors, config_from_fields
from .gguf_writer import LazyTensor
from .qtypes import KIND_OF, QTYPES, unsupported_type_message
from .quants import QuantRows, dequantize
from .staging import copy_rows

_PWRI_U32 = int.from_bytes(K.PWRI_MAGIC, "little")


class _Reader(GGUFReader):
    """gguf's reader, taught to accept upstream PowerInfer's ``PWRI`` magic, slicing a plain
    ndarray view of its map (a np.memmap's own slices cost several times more), and reading an
    array in one pass (gguf's reader parses each item as a field of its own, which for a
    tokenizer's vocabulary is most of the time every process takes to open the file)."""

    def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001
        if "_plain" not in self.__dict__:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = self._plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        arr = arr.view(dt.newbyteorder(self.byte_order if override_order is None else override_order))
        if offset == 0 and count == 1 and len(arr) and int(arr[0]) == _PWRI_U32:
            return np.array([_GGUF_MAGIC_U32], dtype=arr.dtype)
        return arr

    def _get_field_parts(self, orig_offs, raw_type):  # noqa: ANN001, ANN202
        """gguf's parts of a field, which ``ReaderField.contents`` reads alike: an array's items one
        part each (a string's data without its length; numbers as slices of one read)."""
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            vals = self._get(offs, nptype, n)
            return (12 + int(vals.nbytes), [raw_itype, alen, *(vals[i:i + 1] for i in range(n))], list(range(2, 2 + n)),
                    [GGUFValueType.ARRAY, itype])
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        plain, mv, parts = self._plain, memoryview(self._plain), [raw_itype, alen]
        for _ in range(n):
            size = int.from_bytes(mv[offs:offs + 8], "little")
            if offs + 8 + size > len(plain):
                raise ValueError(f"a string of {size} bytes at offset {offs} runs past the file's end")
            parts.append(plain[offs + 8:offs + 8 + size])
            offs += 8 + size
        return offs - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, GGUFValueType.STRING]


class ModelFile:
    """A GGUF model on disk: metadata, ``ModelConfig`` and lazy tensor access.

    ``get(name, rows)`` copies only the requested rows out of the memory map (dequantized when
    the file stores the tensor in blocks); ``layer_blocks`` / ``global_blocks`` hand out a
    Q8_0 / Q4_0 matrix's rows as the blocks themselves (``qtype`` says which tensors come so).
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
            kind = KIND_OF.get(t.tensor_type)
            if kind is None or (kind == "q6_k" and t.name != K.global_tensor(K.OUTPUT)):
                raise self.error(unsupported_type_message(t.name, t.tensor_type.name, str(self.path)))
            if kind not in ("f32", "f16", "bf16") and _is_standard_down(t.name):
                raise self.error(f"tensor {t.name!r} is {t.tensor_type.name} in llama.cpp's layout "
                                 "(neuron j's down weights are column j, across the blocks of every "
                                 "row, so they cannot be read by neuron): convert the HF checkpoint "
                                 "with `powerinfer-ray convert` (it stores ffn_down_t, a row per neuron)")
        self.config = config_from_fields(self.fields, self.tensors, self.is_sparse, self.path)
        if validate:
            check_tensors(self.config, {n: self.shape(n) for n in self.tensors}, self.path)

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
        """The tensor as a numpy memory-map view, no copy: bf16 shows as uint16, block types as
        uint8 [rows, row bytes]."""
        if name not in self.tensors:
            raise self.error(f"missing tensor {name!r}")
        data = self.tensors[name].data
        return data.view(np.uint16) if self.dtype_of(name) == "bf16" else data  # gguf shows BF16 as bytes

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a torch view of the memory map, no copy (numpy's shape; bf16 as
        torch.bfloat16, block types as uint8 [rows, row bytes]). The pages are read-only: writing
        to the view kills the process."""
        arr = self.raw(name)
        with warnings.catch_warnings():  # torch warns that the array is not writable: it is not written
            warnings.simplefilter("ignore", UserWarning)
            if self.dtype_of(name) == "bf16":
                return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(arr)

    def dtype_of(self, name: str) -> str:
        """How the file stores the tensor: f32 | f16 | bf16 | i32 | q8_0 | q4_0 | q6_k."""
        return KIND_OF[self.tensors[name].tensor_type]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's numpy shape in weights (rows, cols), whatever its storage."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def get(self, name: str, rows: Sequence[int] | np.ndarray | torch.Tensor | None = None,
            dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows ``rows`` (all when None) of tensor ``name`` as a torch tensor (a copy); block
        types are dequantized (to ``dtype``, default float32) on ``device``."""
        arr = self.raw(name)
        arr = np.array(arr) if rows is None else arr[np.asarray(rows, dtype=np.int64)]  # a copy
        kind = self.dtype_of(name)
        if kind in QTYPES or kind == "q6_k":
            return dequantize(torch.from_numpy(arr).to(device), kind, dtype or torch.float32)
        return _to_torch(arr, kind, dtype, device)

    def stored(self, name: str) -> LazyTensor:
        """The tensor as the file stores it (float values, or blocks as they are), read when a
        writer reaches it: copying it into another file changes no byte."""
        kind = self.dtype_of(name)
        if kind in QTYPES or kind == "q6_k":
            return LazyTensor(self.shape(name), kind, lambda: np.array(self.raw(name)))
        return LazyTensor(self.shape(name), kind, lambda: self.get(name))

    def blocks(self, name: str, rows: Any = None, device: str | torch.device = "cpu") -> QuantRows:
        """Rows ``rows`` (all when None) of a Q8_0 / Q4_0 tensor as its blocks, gathered straight
        from the memory map."""
        kind = self.dtype_of(name) if name in self.tensors else None
        if kind not in QTYPES:
            raise self.error(f"tensor {name!r} is stored as {kind}, not in blocks of {QTYPES}")
        if torch.device(device).type != "cpu":  # gathered on the way (through pinned buffers when staging)
            ids = None if rows is None else torch.as_tensor(np.asarray(rows, np.int64))
            return QuantRows(copy_rows(self.view(name), ids, device), kind)
        arr = self.raw(name)
        arr = np.array(arr) if rows is None else arr[np.asarray(rows, dtype=np.int64)]  # a copy
        return QuantRows(torch.from_numpy(arr), kind)

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
            down_name = K.tensor(K.FFN_DOWN, bid)
            cols = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
            arr = np.ascontiguousarray(self.raw(down_name)[:, cols].T)  # [F, D] (float: __init__ checks)
            return _to_torch(arr, self.dtype_of(down_name), dtype, device)
        fused = self._fused_rows(template, bid, rows, bias)
        if fused is not None:
            return self.get(fused[0], fused[1], dtype, device)
        raise self.error(f"missing tensor {name!r}")

    def qtype(self, template: str, bid: int | None = None, bias: bool = False) -> str | None:
        """'q8_0' | 'q4_0' when ``layer_blocks`` (``global_blocks`` for bid None) hands the
        tensor's rows out as blocks; None when it comes in float (``layer`` / ``global_``)."""
        name = K.global_tensor(template, bias) if bid is None else K.tensor(template, bid, bias)
        if name not in self.tensors and bid is not None and (fused := self._fused_rows(template, bid, None, bias)):
            name = fused[0]
        kind = self.dtype_of(name) if name in self.tensors else None
        return kind if kind in QTYPES else None

    def layer_blocks(self, template: str, bid: int, rows: Any = None,
                     device: str | torch.device = "cpu") -> QuantRows:
        """Rows of a per-layer Q8_0 / Q4_0 matrix as blocks (see ``qtype``)."""
        name = K.tensor(template, bid)
        if name not in self.tensors and (fused := self._fused_rows(template, bid, rows, False)):
            return self.blocks(*fused, device=device)
        return self.blocks(name, rows, device)

    def global_blocks(self, name: str, rows: Any = None, device: str | torch.device = "cpu") -> QuantRows:
        """Rows of a model-level Q8_0 / Q4_0 matrix (token_embd, output) as blocks."""
        return self.blocks(K.global_tensor(name), rows, device)

    def _fused_rows(self, template: str, bid: int, rows: Any, bias: bool) -> tuple[str, np.ndarray] | None:
        """(fused attn_qkv name, its rows) standing for rows of q, k or v; None without one."""
        fused = K.tensor(K.ATTN_QKV, bid, bias)
        if template not in (K.ATTN_Q, K.ATTN_K, K.ATTN_V) or fused not in self.tensors:
            return None
        base = self._qkv_rows(template)
        return fused, base if rows is None else base[np.asarray(rows, dtype=np.int64)]

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


def _is_standard_down(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[1].isdigit() and K.tensor(K.FFN_DOWN, int(parts[1])) == name


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
