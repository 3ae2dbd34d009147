"""Tensor storage types as this project names them and ggml's Q8_0 / Q4_0 block layouts: names,
sizes and the bytes of a row, without torch (the model config and the command line import it;
``quants`` does the arithmetic).

Blocks hold QK = 32 consecutive weights of one row, so a row of C weights is C / 32 blocks and a
neuron's row is contiguous in the file, gathered by id like an f16 row:

  Q8_0 (34 bytes): f16 scale d, then 32 int8 q;                       x_i = d * q_i
  Q4_0 (18 bytes): f16 scale d, then 16 bytes, byte j = q_j | q_{j+16} << 4;  x_i = d * (q_i - 8)

Q8_0: d = max|x| / 127, q = round(x / d) (half away from zero). Q4_0: d = m / -8 with m the
first element of largest magnitude (sign kept), q = min(15, trunc(x / d + 8.5)).
Q6_K (upstream's ``quantize ... Q4_0`` writes ``output.weight`` so) is dequantized at load
with gguf's reference (``gguf.quants``); it is read, never written.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from . import gguf_keys as K

QK = 32  # weights per block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
QTYPES = tuple(BLOCK_BYTES)  # the block types executors hold as they are
FLOAT_KINDS = ("f32", "f16", "bf16")
QUANT_FALLBACK = "f16"  # a matrix whose rows are not whole blocks stays at this type in a q file
# storage kinds of model-file tensors; q6_k is read (dequantized at load), never written
GGML_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "i32": T.I32, "q8_0": T.Q8_0, "q4_0": T.Q4_0,
              "q6_k": T.Q6_K}
KIND_OF = {t: k for k, t in GGML_TYPES.items()}
ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
# llama.cpp's general.file_type (LlamaFileType) of a file whose matrices are stored at a kind
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}


class QuantError(ValueError):
    """A tensor that cannot be stored or read as the type asked for."""


def row_bytes(kind: str, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` weights stored as ``kind``."""
    if kind in ELEMENT_BYTES:
        return n_cols * ELEMENT_BYTES[kind]
    block, size = gguf_quants.GGML_QUANT_SIZES[GGML_TYPES[kind]]
    if n_cols % block:
        raise QuantError(f"a row of {n_cols} weights is not a whole number of {kind} blocks of {block}")
    return n_cols // block * size


def tensor_bytes(kind: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of (numpy) ``shape`` stored as ``kind``."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows * row_bytes(kind, int(shape[-1]))


def storage_kind(dtype: str, name: str, shape: Sequence[int]) -> str:
    """How a model file whose matrices are ``dtype`` stores tensor ``name``: 1-D tensors (norms,
    biases) at f32; in a q4_0 file ``output.weight`` at q8_0 (upstream writes Q6_K, which has no
    quantizer here; Q8_0 is upstream's choice where Q6_K does not fit); a matrix whose rows are
    not whole blocks at QUANT_FALLBACK; every other matrix at ``dtype``."""
    if len(shape) < 2:
        return "f32"
    if dtype not in QTYPES:
        return dtype
    if int(shape[-1]) % QK:
        return QUANT_FALLBACK
    return "q8_0" if dtype == "q4_0" and name == K.global_tensor(K.OUTPUT) else dtype


def unsupported_type_message(name: str, type_name: str, path: str = "") -> str:
    """One line for a tensor stored in a type this project does not run, and how to convert it."""
    where = path or "IN.gguf"
    return (f"tensor {name!r} has type {type_name}, which is not supported (supported: F32, F16, BF16, "
            f"Q8_0, Q4_0, and Q6_K for output.weight); re-quantize it with "
            f"`powerinfer-ray quantize {where} OUT.gguf q4_0` (or q8_0), or convert the HF checkpoint "
            f"with `powerinfer-ray convert HF_DIR -o OUT.gguf --outtype q4_0`")
