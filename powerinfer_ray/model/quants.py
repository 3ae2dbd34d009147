"""ggml's Q8_0 / Q4_0 blocks (layouts: ``qtypes``) quantized and dequantized in torch, bit-exact with
ggml's reference quantizer, on any device; ``QuantRows``, the rows of a block-quantized matrix as
the kernels take them. Q6_K is dequantized with gguf's reference (``gguf.quants``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from .qtypes import BLOCK_BYTES, QK, QTYPES, QuantError


# ------------------------------------------------------------------------------------------------
# quantize / dequantize
# ------------------------------------------------------------------------------------------------
def quantize(x: torch.Tensor | np.ndarray, qtype: str) -> torch.Tensor:
    """x [R, C] (any float dtype, any device) -> blocks [R, C / 32 * block_bytes] uint8, the
    bytes ``gguf.quants.quantize`` writes for the float32 values of x."""
    x = torch.as_tensor(x)
    if qtype not in BLOCK_BYTES:
        raise QuantError(f"quantize: type {qtype!r}, expected one of {QTYPES}")
    R, C = x.shape
    if C % QK:
        raise QuantError(f"quantize to {qtype}: rows of {C} weights are not a whole number of blocks of {QK}")
    xb = x.float().reshape(R, C // QK, QK)  # [R, nb, 32]
    if qtype == "q8_0":
        d = xb.abs().amax(dim=-1, keepdim=True) / 127  # [R, nb, 1]
        v = xb * torch.where(d == 0, 0.0, 1.0 / d)
        a = v.abs()
        fl = a.floor()
        q = (torch.sign(v) * (fl + torch.floor(2 * (a - fl)))).to(torch.int8).view(torch.uint8)  # round half away
    else:
        m = xb.gather(-1, xb.abs().argmax(dim=-1, keepdim=True))  # first largest magnitude, signed
        d = m / -8
        q = torch.trunc(xb * torch.where(d == 0, 0.0, 1.0 / d) + 8.5).clamp_(0, 15).to(torch.uint8)
        q = q[..., : QK // 2] | (q[..., QK // 2:] << 4)  # [R, nb, 16]
    scale = d.to(torch.float16).view(torch.uint8)  # [R, nb, 2]
    return torch.cat((scale, q), dim=-1).reshape(R, -1)


def dequantize(blocks: torch.Tensor | np.ndarray, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [R, nb * block_bytes] uint8 -> weights [R, nb * 32] in ``dtype`` (computed in f32).
    q6_k goes through gguf's reference dequantizer (on the host)."""
    b = torch.as_tensor(blocks)
    if qtype == "q6_k":
        out = gguf_quants.dequantize(b.cpu().numpy(), T.Q6_K)
        return torch.from_numpy(out).to(device=b.device, dtype=dtype)
    if qtype not in BLOCK_BYTES:
        raise QuantError(f"dequantize: type {qtype!r}, expected one of {QTYPES} or q6_k")
    R = b.shape[0]
    b = b.reshape(R, -1, BLOCK_BYTES[qtype])  # [R, nb, bb]
    d = b[..., :2].contiguous().view(torch.float16).float()  # [R, nb, 1]
    if qtype == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [R, nb, 32]
    else:
        nib = b[..., 2:]
        q = torch.cat((nib & 15, nib >> 4), dim=-1).float() - 8.0  # [R, nb, 32]
    return (d * q).reshape(R, -1).to(dtype)


@dataclass(frozen=True)
class QuantRows:
    """Rows of a block-quantized matrix as the kernels take them: ``blocks`` [n_rows,
    n_cols / 32 * block_bytes] uint8 (ggml blocks, row by row) and their ``qtype``."""

    blocks: torch.Tensor
    qtype: str  # q4_0 | q8_0

    @property
    def n_rows(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def n_cols(self) -> int:
        return int(self.blocks.shape[1]) // BLOCK_BYTES[self.qtype] * QK

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights [n_rows, n_cols] these blocks stand for."""
        return dequantize(self.blocks, self.qtype, dtype)
