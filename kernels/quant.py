"""ggml's Q4_0 and Q8_0 weights as the kernels take them, with float64-exact dequantization.

A quantized matrix [R, C] is a uint8 tensor [R, C // 32 * block_bytes]: each row is C / 32 ggml
blocks of 32 weights, with a qtype string beside it ('q4_0' or 'q8_0'). Rows are contiguous, so a
neuron's row gathers by id as in fp16. A block starts with its f16 scale d:
  q4_0 (18 bytes): 16 bytes; byte i holds element i in its low nibble, element i + 16 in its high
       nibble; value = (nibble - 8) * d.
  q8_0 (34 bytes): 32 int8 q; value = q * d.

Every dequantized value is an f16 times a small integer, exact in fp32, so `dequantize` in fp32
is the exact value and the float64 references take it as is.

The CPU kernels compute as ggml does: the activation x is quantized to Q8_0 once per call
(`quantize_q8_0`, ggml's reference rounding: d = amax / 127, q = round-half-away(x / d)) and
multiplied block by block in integers. Their reference is the float64 product of `round_q8_0(x)`
with the dequantized weights. The GPU kernels dequantize the weights in registers and multiply x
as it is.
"""
from __future__ import annotations

import torch

QK = 32  # weights per block
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}
QTYPES = tuple(BLOCK_BYTES)  # the files' block layouts
REPACKED = {"q4_0": "q4_0r"}  # the repacked rows of a block type (Q8_0's ran slower: kernels/README.md)
GEMV_QTYPES = QTYPES + tuple(REPACKED.values())  # what the dense GEMV (linear.py) takes


def block_qtype(qtype: str) -> str:
    """The block type of a layout: 'q4_0' for 'q4_0' and 'q4_0r'."""
    return qtype[:-1] if qtype in REPACKED.values() else qtype


def check_qtype(qtype: str, where: str, allowed: tuple[str, ...] = QTYPES) -> str:
    if qtype not in allowed:
        raise ValueError(f"{where}: qtype is {qtype!r}, expected one of {allowed} (or None for float weights)")
    return qtype


def row_bytes(qtype: str, n_cols: int) -> int:
    """Bytes of one quantized row of n_cols weights (n_cols a multiple of 32)."""
    return n_cols // QK * BLOCK_BYTES[block_qtype(qtype)]


def n_cols(w: torch.Tensor, qtype: str) -> int:
    """Weights per row of a quantized matrix w [R, row_bytes]."""
    return w.shape[-1] // BLOCK_BYTES[block_qtype(qtype)] * QK


def check_matrix(w: torch.Tensor, qtype: str, cols: int | None, name: str, where: str,
                 allowed: tuple[str, ...] = QTYPES) -> None:
    """ValueError naming the field unless w is a quantized matrix uint8 [R, row_bytes(qtype, cols)]
    (cols None: any whole number of blocks) with unit column stride; qtype one of ``allowed``."""
    check_qtype(qtype, where, allowed)
    bb = BLOCK_BYTES[block_qtype(qtype)]
    if cols is not None and cols % QK:
        raise ValueError(f"{where}: the row length is {cols}, expected a multiple of {QK} for {qtype} weights")
    want = f"uint8 [R, {row_bytes(qtype, cols) if cols is not None else f'k * {bb}'}] ({qtype} blocks of {bb} bytes)"
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.uint8:
        raise ValueError(f"{where}: {name} is {getattr(w, 'dtype', type(w).__name__)} "
                         f"{tuple(getattr(w, 'shape', ()))}, expected {want}")
    if (cols is not None and w.shape[1] != row_bytes(qtype, cols)) or w.shape[1] % bb:
        raise ValueError(f"{where}: {name}.shape is {tuple(w.shape)}, expected {want}")
    if w.shape[1] > 1 and w.stride(1) != 1:
        raise ValueError(f"{where}: {name}.stride() is {w.stride()}, expected rows with unit column stride")


def dequantize(w: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w uint8 [..., k * block_bytes] (blocks, or repacked rows) -> [..., k * 32] in dtype (fp32
    and wider: exact). Any device."""
    bq = block_qtype(check_qtype(qtype, "dequantize", GEMV_QTYPES))
    bb = BLOCK_BYTES[bq]
    k = w.shape[-1] // bb  # explicit: no rows (an empty gather) leaves -1 ambiguous
    if bq == qtype:
        blocks = w.reshape(*w.shape[:-1], k, bb)  # [..., k, bb]
        d, qb = blocks[..., :2], blocks[..., 2:]  # [..., k, 2], [..., k, bb - 2]
    else:
        qb = w[..., :k * (bb - 2)].reshape(*w.shape[:-1], k, bb - 2)
        d = w[..., k * (bb - 2):].reshape(*w.shape[:-1], k, 2)
    d = d.contiguous().view(torch.float16).to(dtype)  # [..., k, 1]
    if bq == "q8_0":
        q = qb.contiguous().view(torch.int8)  # [..., k, 32]
    else:
        q = torch.cat([qb & 15, qb >> 4], dim=-1).to(torch.int8) - 8  # [..., k, 32]
    return (q.to(dtype) * d).reshape(*w.shape[:-1], k * 32)


def repackable(w: torch.Tensor, qtype: str | None) -> bool:
    """Whether `repack` takes w: Q4_0 blocks whose rows are a whole number of 32-bit words."""
    return qtype in REPACKED and w.dim() == 2 and w.shape[1] % 4 == 0


def repack(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Blocks w uint8 [R, k * block_bytes] as repacked rows (see the module docstring), contiguous:
    a new tensor of w's shape on w's device, for qtype ``REPACKED[qtype]``."""
    bb = BLOCK_BYTES[check_qtype(qtype, "repack", tuple(REPACKED))]
    if not repackable(w, qtype):
        raise ValueError(f"repack: {qtype} rows of shape {tuple(w.shape)}: expected [R, k * {bb}] with 4 | k * {bb}")
    R, k = w.shape[0], w.shape[1] // bb
    blocks = w.reshape(R, k, bb)
    return torch.cat([blocks[..., 2:].reshape(R, -1), blocks[..., :2].reshape(R, -1)], dim=1).contiguous()


def repack_(w: torch.Tensor, qtype: str, chunk_bytes: int = 8 << 20) -> str:
    """`repack` in place (a chunk of rows at a time: no second copy of w); returns the new qtype."""
    step = max(1, chunk_bytes // max(1, w.shape[1]))
    for a in range(0, w.shape[0], step):
        w[a:a + step] = repack(w[a:a + step], qtype)
    return REPACKED[qtype]


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 32) -> Q8_0 blocks uint8 [..., D // 32 * 34], as ggml's reference
    quantize_row_q8_0 (and gguf-py) compute them in fp32: d = amax / 127, q = round-half-away(x / d)."""
    if x.shape[-1] % QK:
        raise ValueError(f"quantize_q8_0: the last dimension is {x.shape[-1]}, expected a multiple of {QK}")
    b = x.float().reshape(*x.shape[:-1], -1, QK)  # [..., k, 32]
    d = b.abs().amax(-1, keepdim=True) / 127  # [..., k, 1] fp32
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = b * inv
    a = v.abs()
    q = (torch.sign(v) * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)  # gguf-py's np_roundf
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [..., k, 34]
    return out.reshape(*x.shape[:-1], -1)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """The values the CPU kernels multiply for x [..., D]: its Q8_0 round trip, float64."""
    return dequantize(quantize_q8_0(x), "q8_0", torch.float64)
