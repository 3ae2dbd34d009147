"""The two-stage Triton kernels of the sparse FFN and what the FFN kernels share (imported lazily:
triton is optional).

Dimension legend: T tokens, TP = T padded for tl.dot (>= 16), D n_embd, K active rows (idx),
BK rows per tile, BD columns per tile.

Two launches, no atomics, no memset, fp32 accumulation:
  1. up stage, grid cdiv(K, BK): a program owns BK active neurons, streams their up (and gate)
     rows over D once, and writes h [T, K] fp32 = mask * act(gate . x, up . x + b). K is the
     index's capacity; a program past the device count n_active returns at once.
  2. down stage, grid cdiv(D, BD): a program owns BD output columns, streams the BD-wide slices
     of all active down_t rows, and writes y [T, BD] in y's dtype. A row whose h is zero for every
     token is not loaded (masked loads issue no memory traffic).
T == 1 uses elementwise multiply-add kept as [BK, BD] partial sums, reduced once at the end (or
the tl.dot kernels: Config.up_dot / down_dot); T > 1 uses tl.dot with tokens padded to 16
(fp16 / bf16 operands when x has the weights' dtype, else fp32 operands under tf32x3). The down
stage multiplies fp32 h with the weights widened to fp32 under tf32 (fp16 / bf16 weights are exact
in tf32) or tf32x3 (fp32 and quantized weights).

Weights are plain rows (QT 0) or ggml blocks (QT 1 q4_0, QT 2 q8_0; quant.py): `_w_tile` loads a
tile of either as values, dequantizing blocks in registers, so every FFN kernel serves both. Block
rows are read as 16-bit words (`w_arg`: a block is its f16 scale word, then 8 / 16 words of
quants), one load per word; a Q4_0 tile's entries come out in the words' order, a fixed
permutation of each block's 32 columns (`_tile_cols`), at which the kernels load x and store y.

SwiGLU sparsity (sparse_ffn.py): THR 1 / 2 zero h where |SiLU(g)| / |h| is not above `thr`;
GPRE takes g from a precomputed fp32 [T, N] (the gate-first mode) instead of the gate rows
(HAS_GATE: the gate rows are read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ACT_CODE = {"relu": 0, "reglu": 1, "drelu": 2, "swiglu": 3, "none": 4}  # none: h = u (the dense linear)
QT_CODE = {None: 0, "q4_0": 1, "q8_0": 2}
THR_CODE = {None: 0, "gate": 1, "h": 2}  # an activation threshold's criterion (none: no threshold)


@dataclass(frozen=True)
class Config:
    """Tile sizes of the FFN kernels (chosen by bench/kernels_bench.py --sweep on the H200).
    up_dot / down_dot: at T == 1, use the tl.dot kernels (tokens padded to 16) instead of the
    elementwise ones; tl.dot loops get cp.async software pipelining (num_stages), which keeps
    more bytes in flight than the elementwise loops. T > 1 always uses tl.dot. fused_r > 0 (T ==
    1): the fused kernel of triton_fused.py instead of the two stages."""

    up_bk: int
    up_bd: int
    up_warps: int
    down_bk: int
    down_bd: int
    down_warps: int
    up_stages: int = 3
    down_stages: int = 3
    up_dot: bool = True
    down_dot: bool = True
    # Fused kernel (T == 1; fused_r > 0 selects it): one launch of fused_progs programs per SM,
    # each walking blocks of fused_r active rows with the next block's whole up, gate and down rows
    # in flight (eager_down: before the activation is known; else a zero activation skips its down
    # row), h * down summed in registers, then added into an fp32 scratch with atomics; the last
    # program to finish casts it into y and zeroes it again (fused_warps warps per program).
    fused_r: int = 0
    fused_warps: int = 8
    fused_progs: int = 2
    eager_down: bool = True

    @property
    def fused(self) -> bool:
        return self.fused_r > 0


@triton.jit
def _tile_cols(c0, C: tl.constexpr, QT: tl.constexpr):
    """[C] the weight columns of the entries of a `_w_tile` tile starting at column c0: c0 .. c0 +
    C - 1, except Q4_0 (QT 1), whose entry p of a block of 32 holds column 2 (p // 4) + (p // 2) % 2
    + 16 (p % 2) of the block (the order its 16-bit words unpack in)."""
    p = tl.arange(0, C)
    if QT == 1:
        q = p % 32
        p = p - q + 2 * (q // 4) + (q // 2) % 2 + 16 * (q % 2)
    return c0 + p


@triton.jit
def _w_tile(ptr, rows, stride, c0, D, rmask, C: tl.constexpr, QT: tl.constexpr, CMASK: tl.constexpr = True):
    """[R, C] tile of weight rows `rows` [R] (rmask [R]) at columns `_tile_cols(c0, C, QT)`, masked to
    columns < D (CMASK; else every column is < D): the stored values (QT 0), or for ggml blocks (QT 1
    q4_0, QT 2 q8_0; c0 and C multiples of 32, ptr and stride as `w_arg` gives them: int16 words)
    the dequantized fp32 values, the block's f16 scale d times (nibble - 8) or the int8 q."""
    if QT == 0:
        cols = c0 + tl.arange(0, C)
        m = rmask[:, None]
        if CMASK:
            m = m & (cols < D)[None, :]
        w = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=m, other=0.0)
    else:
        NB: tl.constexpr = C // 32  # blocks in the tile
        WB: tl.constexpr = 8 * QT  # words of quants per block (Q4_0: 8, Q8_0: 16), after the scale word
        b = c0 // 32 + tl.arange(0, NB)  # [NB]
        bm = rmask[:, None] & (b < D // 32)[None, :]  # [R, NB]
        blk = ptr + rows[:, None] * stride + (b * (WB + 1))[None, :]  # [R, NB] scale words
        d = tl.load(blk, mask=bm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        wo = 1 + tl.arange(0, WB)
        v = tl.load(blk[:, :, None] + wo[None, None, :], mask=bm[:, :, None], other=0).to(tl.int32) & 0xFFFF
        if QT == 1:  # word j: bytes 2j, 2j + 1 = columns 2j, 2j + 16 and 2j + 1, 2j + 17 (low, high nibbles)
            q = tl.join(tl.join(v & 15, (v >> 8) & 15), tl.join((v >> 4) & 15, v >> 12))  # [R, NB, WB, 2, 2]
            w = tl.reshape((q - 8).to(tl.float32) * d[:, :, None, None, None], (rows.shape[0], C))
        else:  # word j: columns 2j, 2j + 1 (int8 each)
            q = tl.join(((v & 255) ^ 128) - 128, ((v >> 8) ^ 128) - 128)  # [R, NB, WB, 2]
            w = tl.reshape(q.to(tl.float32) * d[:, :, None, None], (rows.shape[0], C))
    return w


@triton.jit
def _act(u, g, ACT: tl.constexpr):
    if ACT == 0:
        h = tl.maximum(u, 0.0)
    elif ACT == 1:
        h = tl.where(g > 0, g * u, 0.0)
    elif ACT == 2:
        h = tl.where((g > 0) & (u > 0), g * u, 0.0)
    elif ACT == 3:
        h = g / (1.0 + tl.exp(-g)) * u
    else:  # none: the dense linear
        h = u
    return h


@triton.jit
def _thresholded(h, g, thr, THR: tl.constexpr):
    """h with the entries whose criterion is not above thr zeroed: |SiLU(g)| (THR 1), |h| (THR 2)."""
    if THR == 1:
        h = tl.where(tl.abs(g / (1.0 + tl.exp(-g))) > thr, h, 0.0)
    elif THR == 2:
        h = tl.where(tl.abs(h) > thr, h, 0.0)
    return h


@triton.jit
def _block_rows(idx_ptr, b, kc, R: tl.constexpr):
    """Entries, their mask (< kc) and row ids of block b of R active rows (none past the end)."""
    offs = b * R + tl.arange(0, R)
    m = offs < kc
    return offs, m, tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)


@triton.jit
def _rows_dot_x(x_ptr, up_ptr, gate_ptr, rows, kmask, D, s_up, s_gate,
                HAS_GATE: tl.constexpr, QT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T == 1: (up . x, gate . x) of BK rows, as [BK] fp32 sums."""
    acc_u = tl.zeros((BK, BD), dtype=tl.float32)
    acc_g = tl.zeros((BK, BD), dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = _tile_cols(d0, BD, QT)  # [BD]
        xv = tl.load(x_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # [BD]
        wu = _w_tile(up_ptr, rows, s_up, d0, D, kmask, BD, QT)  # [BK, BD]
        acc_u += wu.to(tl.float32) * xv[None, :]
        if HAS_GATE:
            wg = _w_tile(gate_ptr, rows, s_gate, d0, D, kmask, BD, QT)
            acc_g += wg.to(tl.float32) * xv[None, :]
    return tl.sum(acc_u, axis=1), tl.sum(acc_g, axis=1)


@triton.jit
def _up_gemv_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, idx_ptr, nact_ptr, mask_ptr, h_ptr, gpre_ptr,
                    D, K, s_up, s_gate, thr,
                    ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    MASK_MODE: tl.constexpr, HAS_NACT: tl.constexpr, QT: tl.constexpr,
                    THR: tl.constexpr, GPRE: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T == 1: h[k] for BK active rows; x [D], h [K]."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    if pid * BK >= K:  # past the active rows (the grid covers the shard's capacity): no masked D loop
        return
    offs_k, kmask, rows = _block_rows(idx_ptr, pid, K, BK)  # [BK]
    u, g = _rows_dot_x(x_ptr, up_ptr, gate_ptr, rows, kmask, D, s_up, s_gate, HAS_GATE, QT, BK, BD)  # [BK]
    if GPRE:
        g = tl.load(gpre_ptr + rows, mask=kmask, other=0.0)
    if HAS_BIAS:
        u += tl.load(bias_ptr + rows, mask=kmask, other=0.0).to(tl.float32)
    h = _thresholded(_act(u, g, ACT), g, thr, THR)
    if MASK_MODE == 1:
        h = tl.where(tl.load(mask_ptr + offs_k, mask=kmask, other=0) != 0, h, 0.0)
    elif MASK_MODE == 2:
        h = tl.where((tl.load(mask_ptr + offs_k, mask=kmask, other=0) & 1) != 0, h, 0.0)
    tl.store(h_ptr + offs_k, h, mask=kmask)


@triton.jit
def _h_tile(u, g, rows, offs_k, offs_t, kmask, tmask, bias_ptr, mask_ptr, s_mask, thr,
            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, THR: tl.constexpr):
    """h [BK, TP] = act(g, u + bias) of BK active rows and TP (padded) tokens, zero where the mask,
    the threshold, the row count or the token count say inactive."""
    if HAS_BIAS:
        u += tl.load(bias_ptr + rows, mask=kmask, other=0.0).to(tl.float32)[:, None]
    h = _thresholded(_act(u, g, ACT), g, thr, THR)
    live = kmask[:, None] & tmask[None, :]
    if MASK_MODE == 1:
        live = live & (tl.load(mask_ptr + offs_t[None, :] * s_mask + offs_k[:, None], mask=live, other=0) != 0)
    elif MASK_MODE == 2:
        bits = tl.load(mask_ptr + offs_k, mask=kmask, other=0)  # [BK]
        live = live & (((bits[:, None] >> offs_t[None, :]) & 1) != 0)
    return tl.where(live, h, 0.0)


@triton.jit
def _up_dot_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, idx_ptr, nact_ptr, mask_ptr, h_ptr, gpre_ptr,
                   T, D, K, s_x, s_up, s_gate, s_mask, s_h, s_gpre, thr,
                   ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   MASK_MODE: tl.constexpr, HAS_NACT: tl.constexpr, DOT_F32: tl.constexpr, QT: tl.constexpr,
                   THR: tl.constexpr, GPRE: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T > 1: h[t, k] for BK active rows and all tokens; x [T, D], h [T, K]."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    if pid * BK >= K:  # past the active rows: no masked tl.dot loop
        return
    offs_k, kmask, rows = _block_rows(idx_ptr, pid, K, BK)  # [BK]
    offs_t = tl.arange(0, TP)  # [TP]
    tmask = offs_t < T
    acc_u = tl.zeros((BK, TP), dtype=tl.float32)
    acc_g = tl.zeros((BK, TP), dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = _tile_cols(d0, BD, QT)
        xt = tl.load(x_ptr + offs_t[:, None] * s_x + cols[None, :],
                     mask=tmask[:, None] & (cols < D)[None, :], other=0.0)  # [TP, BD]
        wu = _w_tile(up_ptr, rows, s_up, d0, D, kmask, BD, QT)  # [BK, BD]
        if DOT_F32:
            xf = tl.trans(xt.to(tl.float32))  # [BD, TP]
            acc_u = tl.dot(wu.to(tl.float32), xf, acc_u, input_precision="tf32x3")
        else:
            acc_u = tl.dot(wu, tl.trans(xt), acc_u)
        if HAS_GATE:
            wg = _w_tile(gate_ptr, rows, s_gate, d0, D, kmask, BD, QT)
            if DOT_F32:
                acc_g = tl.dot(wg.to(tl.float32), tl.trans(xt.to(tl.float32)), acc_g, input_precision="tf32x3")
            else:
                acc_g = tl.dot(wg, tl.trans(xt), acc_g)
    if GPRE:  # [BK, TP] precomputed gate values of the rows
        acc_g = tl.load(gpre_ptr + offs_t[None, :] * s_gpre + rows[:, None], mask=kmask[:, None] & tmask[None, :],
                        other=0.0)
    h = _h_tile(acc_u, acc_g, rows, offs_k, offs_t, kmask, tmask, bias_ptr, mask_ptr, s_mask, thr,
                ACT, HAS_BIAS, MASK_MODE, THR)
    tl.store(h_ptr + offs_t[None, :] * s_h + offs_k[:, None], h, mask=kmask[:, None] & tmask[None, :])


@triton.jit
def _down_gemv_kernel(h_ptr, down_ptr, idx_ptr, nact_ptr, y_ptr, D, K, s_down,
                      HAS_NACT: tl.constexpr, QT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T == 1: y[d] = sum_k h[k] down_t[idx[k], d] for BD columns."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    cols = _tile_cols(pid * BD, BD, QT)  # [BD]
    acc = tl.zeros((BK, BD), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)  # [BK]
        kmask = offs_k < K
        rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
        h = tl.load(h_ptr + offs_k, mask=kmask, other=0.0)  # [BK]
        live = kmask & (h != 0)  # zero activation: skip the row's bytes
        w = _w_tile(down_ptr, rows, s_down, pid * BD, D, live, BD, QT)  # [BK, BD]
        acc += h[:, None] * w.to(tl.float32)
    tl.store(y_ptr + cols, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _down_dot_kernel(h_ptr, down_ptr, idx_ptr, nact_ptr, y_ptr, T, D, K, s_down, s_h, s_y,
                     HAS_NACT: tl.constexpr, PREC: tl.constexpr, QT: tl.constexpr,
                     TP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T > 1: y[t, d] = sum_k h[t, k] down_t[idx[k], d] for all tokens and BD columns."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    cols = _tile_cols(pid * BD, BD, QT)  # [BD]
    offs_t = tl.arange(0, TP)
    tmask = offs_t < T
    acc = tl.zeros((TP, BD), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
        h = tl.load(h_ptr + offs_t[:, None] * s_h + offs_k[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)  # [TP, BK]
        live = kmask & (tl.max(tl.abs(h), axis=0) > 0)  # [BK]
        w = _w_tile(down_ptr, rows, s_down, pid * BD, D, live, BD, QT)  # [BK, BD]
        acc = tl.dot(h, w.to(tl.float32), acc, input_precision=PREC)
    tl.store(y_ptr + offs_t[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & (cols < D)[None, :])


def w_arg(w: torch.Tensor, qtype: str | None) -> tuple[torch.Tensor, int]:
    """(the tensor a kernel reads for weight rows w, its row stride in the kernel's elements): w
    itself, or a qtype's uint8 block rows as int16 words (whole blocks are an even number of bytes)."""
    if qtype is None:
        return w, w.stride(0)
    assert w.stride(0) % 2 == 0 and w.storage_offset() % 2 == 0, \
        f"{qtype} rows of stride {w.stride(0)} at offset {w.storage_offset()}: expected whole blocks"
    return w.view(torch.int16), w.stride(0) // 2


def tile_width(bd: int, qtype: str | None) -> int:
    """A tile's columns: bd, at least one block (32 columns) for quantized rows."""
    return bd if qtype is None else max(32, bd)


def mask_args(mask: torch.Tensor | None, dummy: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """(MASK_MODE, pointer, row stride): 0 none, 1 bool [T, K] (as uint8: triton has no bool
    pointers), 2 int32 token bits [K]."""
    if mask is None:
        return 0, dummy, 0
    if mask.dtype == torch.bool:
        return 1, mask.view(torch.uint8), mask.stride(0)
    return 2, mask, 0


def swiglu_args(act_threshold: float | None, act_on: str, gate_pre: torch.Tensor | None,
                dummy: torch.Tensor) -> tuple[dict, torch.Tensor, int, float]:
    """(THR / GPRE constexprs, gate_pre pointer, its row stride, the threshold as the kernels take it)."""
    code = THR_CODE[act_on if act_threshold is not None else None]
    gp = gate_pre if gate_pre is not None else dummy
    return (dict(THR=code, GPRE=gate_pre is not None), gp, gate_pre.stride(0) if gate_pre is not None else 0,
            float(act_threshold or 0.0))


def launch_up(x, up, gate, up_bias, idx, mask, n_active, act, h, cfg: Config, qtype: str | None = None, *,
              act_threshold: float | None = None, act_on: str = "gate", gate_pre: torch.Tensor | None = None) -> None:
    """Stage 1: h [T, K] fp32 from x [T, D] and the active rows of up / gate (quantized rows with
    a qtype); an activation threshold and precomputed gate values as sparse_ffn takes them."""
    T, D = x.shape
    K = idx.shape[0]
    if K == 0:
        return
    dummy = idx  # any tensor: pointer arguments the kernel never reads
    mode, mask, s_mask = mask_args(mask, dummy)
    sw, gp, s_gp, thr = swiglu_args(act_threshold, act_on, gate_pre, dummy)
    common = dict(ACT=ACT_CODE[act], HAS_GATE=gate is not None and gate_pre is None, HAS_BIAS=up_bias is not None,
                  MASK_MODE=mode, HAS_NACT=n_active is not None, QT=QT_CODE[qtype], **sw)
    dot_f32 = x.dtype != up.dtype or up.dtype == torch.float32  # (quantized rows: uint8 != x's dtype)
    up_w, s_up = w_arg(up, qtype)
    gate_w, s_gate = w_arg(gate, qtype) if gate is not None else (up_w, s_up)
    ptrs = (x, up_w, gate_w, up_bias if up_bias is not None else dummy, idx,
            n_active if n_active is not None else dummy, mask, h, gp)
    if T == 1 and not cfg.up_dot:
        grid = (triton.cdiv(K, cfg.up_bk),)
        _up_gemv_kernel[grid](*ptrs, D, K, s_up, s_gate, thr, BK=cfg.up_bk, BD=tile_width(cfg.up_bd, qtype),
                              num_warps=cfg.up_warps, num_stages=cfg.up_stages, **common)
    else:
        bk = max(16, cfg.up_bk)
        tp = max(16, triton.next_power_of_2(T))
        bd = min(cfg.up_bd, 64) if dot_f32 else cfg.up_bd  # tf32x3 tiles spill registers beyond 64
        _up_dot_kernel[(triton.cdiv(K, bk),)](
            *ptrs, T, D, K, x.stride(0), s_up, s_gate, s_mask, h.stride(0), s_gp, thr,
            DOT_F32=dot_f32, TP=tp, BK=bk, BD=tile_width(bd, qtype), num_warps=cfg.up_warps,
            num_stages=cfg.up_stages, **common)


def launch_down(h, down_t, idx, n_active, y, cfg: Config, qtype: str | None = None) -> None:
    """Stage 2: y [T, D] (y's dtype) from h [T, K] and the active rows of down_t (quantized rows
    with a qtype)."""
    T, D = y.shape
    K = idx.shape[0]
    nact = n_active if n_active is not None else idx
    down_w, s_down = w_arg(down_t, qtype)
    if T == 1 and not cfg.down_dot:
        bd = tile_width(cfg.down_bd, qtype)
        _down_gemv_kernel[(triton.cdiv(D, bd),)](
            h, down_w, idx, nact, y, D, K, s_down, HAS_NACT=n_active is not None, QT=QT_CODE[qtype],
            BK=cfg.down_bk, BD=bd, num_warps=cfg.down_warps, num_stages=cfg.down_stages)
    else:
        tp = max(16, triton.next_power_of_2(T))
        prec = "tf32" if down_t.dtype in (torch.float16, torch.bfloat16) and qtype is None else "tf32x3"
        bd = tile_width(max(16, cfg.down_bd), qtype)
        _down_dot_kernel[(triton.cdiv(D, bd),)](
            h, down_w, idx, nact, y, T, D, K, s_down, h.stride(0), y.stride(0),
            HAS_NACT=n_active is not None, PREC=prec, QT=QT_CODE[qtype], TP=tp, BK=max(16, cfg.down_bk), BD=bd,
            num_warps=cfg.down_warps, num_stages=cfg.down_stages)
