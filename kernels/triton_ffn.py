"""Triton kernels of the sparse FFN on the GPU (imported lazily: triton is optional).

Dimension legend: T tokens, TP = T padded for tl.dot (>= 16), D n_embd, K active rows (idx),
BK rows per tile, BD columns per tile.

T == 1 (decode of one sequence): the fused kernel (`_fused_kernel`, Config.fused_r > 0, the
default). One launch of fused_progs programs per SM; each walks blocks pid, pid + P, ... of
fused_r active rows, loading a block's whole up, gate (and, eager_down, down) rows while the
previous block's arithmetic runs, sums h * down in registers, then adds its [D] partial into an
fp32 scratch with atomics; the last program to take a ticket writes y and zeroes the scratch (the
scratch is per device: calls must be stream-ordered, as on the runtime's one stream per GPU).
H200, 13B shape, fp16 (docs/log/kernels-notes.md, graph replays): 10 % density
26.0 us (39 % of the copy ceiling) against 34.6 us for the two-stage kernels below, 50 % 72 %;
the fixed cost, ~11 us at 1 %, is what keeps 10 % from the 70 % bar (launch, the idx -> row
round trips, the atomics, fence and ticket, the last program's cast).

Two-stage kernels (T > 1, the default; T == 1 with fused_r = 0), two launches, no atomics, no
memset, fp32 accumulation:
  1. up stage, grid cdiv(K, BK): a program owns BK active neurons, streams their up (and gate)
     rows over D once, and writes h [T, K] fp32 = mask * act(gate . x, up . x + b).
  2. down stage, grid cdiv(D, BD): a program owns BD output columns, streams the BD-wide
     slices of all active down_t rows, and writes y [T, BD] in y's dtype. A row whose h is zero
     for every token is not loaded (masked loads issue no memory traffic).
T == 1 uses elementwise multiply-add kept as [BK, BD] partial sums (reduced once at the end);
T > 1 uses tl.dot with tokens padded to 16 (tensor cores; fp16/bf16 operands when x has the
weights' dtype, else fp32 operands with tf32x3). Either kernel serves any T == 1 (Config.up_dot /
down_dot). Each stage alone is latency-chain bound (H200, 10 %: up 1.6 TB/s, down 0.8 TB/s): a
program walks D (up) or K (down) in sequential steps of ~1 us. The down stage multiplies fp32 h
with the weights widened to fp32 under tf32 (fp16/bf16 weights are exact in tf32; h is rounded
to tf32, relative 2^-11) or tf32x3 for fp32 weights.

`n_active` (device int32 [1]) bounds K inside the kernels: no host sync, CUDA-graph safe.

Split path (`Config.up_sd` / `down_sk`; T > 1 with POWERINFER_RAY_GPU_SPLIT=1): one memset,
then the up stage with up_sd programs over D per row block, adding partial pre-activations into
fp32 u, g [T, K] with atomics (T = 8 at 10 %: 14.3 us against 28.2 for the unsplit up stage,
whose 44 programs each walked D in 20 steps; ncu, bench/results/kernels-ncu-h200*.txt). T > 1: a
small kernel applies bias, activation and mask in place, and the tl.dot down stage runs with its
column blocks' rows over down_sk programs adding into an fp32 y (then cast). H200, T = 8, graph
replays (kernels-nvidia-h200-v8.json; the two-stage kernels from -v7): 10 % 38.4 us (26 % of copy)
against 48.4, 50 % 110 against 164; not the default (the hybrid at batch 8 ran slower with it,
see CONFIGS). T == 1 (elementwise kernels, the activation applied in the down stage): never won a sweep
(35.5 us at 10 % in the last one, against 26.0 for the fused kernel); kept for the comparison.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ACT_CODE = {"relu": 0, "reglu": 1, "drelu": 2, "swiglu": 3}
# Tokens per launch: the T > 1 kernels keep [TP, BD] token tiles in shared memory. Not 64: with
# TP = 64 the results on the H200 were wrong (rel err 1.35 at T = 64 and 256, GPU test
# test_triton_at_llama13b_shape; under the interpreter they are right). Not investigated further:
# a 64-row tl.dot is where Triton switches to Hopper's wgmma, the likely place. TP <= 32 passed
# at every shape tested on the H200.
MAX_T = 32


@dataclass(frozen=True)
class Config:
    """Tile sizes of the two stages (chosen by bench/kernels_bench.py --sweep on the H200).
    up_dot / down_dot: at T == 1, use the tl.dot kernels (tokens padded to 16) instead of the
    elementwise ones; tl.dot loops get cp.async software pipelining (num_stages), which keeps
    more bytes in flight than the elementwise loops. T > 1 always uses tl.dot."""

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
    # T == 1 split variant (both > 0 selects it; masks fall back to the two-stage path): the up
    # stage splits D over up_sd programs per row block and adds partial pre-activations into fp32
    # with atomics; the down stage applies the activation as it loads them and splits the active
    # rows over down_sk programs per column block, adding into an fp32 y. More programs with
    # fewer sequential steps each (the two-stage kernels are latency-chain bound: kernels/README.md).
    up_sd: int = 0
    down_sk: int = 0
    # Fused variant (T == 1; fused_r > 0 selects it): one launch of fused_progs programs per SM,
    # each walking blocks of fused_r active rows with the next block's whole up, gate and down rows
    # in flight (eager_down: before the activation is known; else a zero activation skips its down
    # row), h * down summed in registers, then added into an fp32 scratch with atomics; the last
    # program to finish casts it into y and zeroes it again (fused_warps warps per program).
    fused_r: int = 0
    fused_warps: int = 8
    fused_progs: int = 2
    eager_down: bool = True

    @property
    def split(self) -> bool:
        return self.up_sd > 0 and self.down_sk > 0

    @property
    def fused(self) -> bool:
        return self.fused_r > 0


# T == 1 and T > 1 defaults: the winners of `bench/kernels_bench.py --sweep` on the H200 (10 %
# density of the Llama-2-13B FFN, fp16). T == 1: the fused kernel, 2 rows per block, 4 warps, 2
# programs per SM, lazy down rows: 26.0 us as a graph replay against 34.6 for the two-stage
# kernels (docs/log/kernels-notes.md); its two-stage tiles (the elementwise
# kernels, which beat the tl.dot ones: up 17.6 vs 28.8 us, down 17.2 vs 21.1 us) are what a
# Config with fused_r = 0 runs. T > 1: the two-stage tl.dot kernels. POWERINFER_RAY_GPU_SPLIT=1
# selects the split path (D over 5 programs per block of 16 rows, each column block's rows over 2
# programs): faster on the GPU (T = 8, 10 %: 38.5 vs 48.0 us as graph replays,
# kernels-nvidia-h200-v8.json; dense-gpu at batch 8 311-314 vs 345-351 us of GPU compute per
# layer), yet the 13B hybrid at batch 8 decoded slower with it in all six engine pairs on the
# host (82-132 vs 131-145 tok/s; runtime-13b-16gib-b8-*-h200*.json, docs/log/kernels-notes.md). Not
# explained; so not the default.
TWO_STAGE_DOT = Config(up_bk=32, up_bd=256, up_warps=8, down_bk=256, down_bd=32, down_warps=4, down_stages=4)
SPLIT_DOT = Config(up_bk=16, up_bd=256, up_warps=4, down_bk=256, down_bd=32, down_warps=4, up_sd=5, down_sk=2)
CONFIGS = {
    "gemv": Config(up_bk=4, up_bd=1024, up_warps=4, down_bk=128, down_bd=32, down_warps=8,
                   up_dot=False, down_dot=False, fused_r=2, fused_warps=4, fused_progs=2, eager_down=False),
    "dot": SPLIT_DOT if os.environ.get("POWERINFER_RAY_GPU_SPLIT") == "1" else TWO_STAGE_DOT,
}


@triton.jit
def _act(u, g, ACT: tl.constexpr):
    if ACT == 0:
        h = tl.maximum(u, 0.0)
    elif ACT == 1:
        h = tl.where(g > 0, g * u, 0.0)
    elif ACT == 2:
        h = tl.where((g > 0) & (u > 0), g * u, 0.0)
    else:
        h = g / (1.0 + tl.exp(-g)) * u
    return h


@triton.jit
def _rows_dot_x(x_ptr, up_ptr, gate_ptr, rows, kmask, d_lo, d_hi, s_up, s_gate,
                HAS_GATE: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T == 1: (up . x, gate . x) over columns [d_lo, d_hi) of BK rows, as [BK] fp32 sums."""
    acc_u = tl.zeros((BK, BD), dtype=tl.float32)
    acc_g = tl.zeros((BK, BD), dtype=tl.float32)
    for d0 in range(d_lo, d_hi, BD):
        offs_d = d0 + tl.arange(0, BD)  # [BD]
        dmask = offs_d < d_hi
        xv = tl.load(x_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)  # [BD]
        wmask = kmask[:, None] & dmask[None, :]
        wu = tl.load(up_ptr + rows[:, None] * s_up + offs_d[None, :], mask=wmask, other=0.0)  # [BK, BD]
        acc_u += wu.to(tl.float32) * xv[None, :]
        if HAS_GATE:
            wg = tl.load(gate_ptr + rows[:, None] * s_gate + offs_d[None, :], mask=wmask, other=0.0)
            acc_g += wg.to(tl.float32) * xv[None, :]
    return tl.sum(acc_u, axis=1), tl.sum(acc_g, axis=1)


@triton.jit
def _up_gemv_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, idx_ptr, nact_ptr, mask_ptr, h_ptr,
                    D, K, s_up, s_gate,
                    ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    MASK_MODE: tl.constexpr, HAS_NACT: tl.constexpr,
                    BK: tl.constexpr, BD: tl.constexpr):
    """T == 1: h[k] for BK active rows; x [D], h [K]."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    offs_k = pid * BK + tl.arange(0, BK)  # [BK]
    kmask = offs_k < K
    rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)  # [BK]
    u, g = _rows_dot_x(x_ptr, up_ptr, gate_ptr, rows, kmask, 0, D, s_up, s_gate, HAS_GATE, BK, BD)  # [BK]
    if HAS_BIAS:
        u += tl.load(bias_ptr + rows, mask=kmask, other=0.0).to(tl.float32)
    h = _act(u, g, ACT)
    if MASK_MODE == 1:
        h = tl.where(tl.load(mask_ptr + offs_k, mask=kmask, other=0) != 0, h, 0.0)
    elif MASK_MODE == 2:
        h = tl.where((tl.load(mask_ptr + offs_k, mask=kmask, other=0) & 1) != 0, h, 0.0)
    tl.store(h_ptr + offs_k, h, mask=kmask)


@triton.jit
def _h_tile(u, g, rows, offs_k, offs_t, kmask, tmask, bias_ptr, mask_ptr, s_mask,
            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr):
    """h [BK, TP] = act(g, u + bias) of BK active rows and TP (padded) tokens, zero where the mask,
    the row count or the token count say inactive."""
    if HAS_BIAS:
        u += tl.load(bias_ptr + rows, mask=kmask, other=0.0).to(tl.float32)[:, None]
    h = _act(u, g, ACT)
    live = kmask[:, None] & tmask[None, :]
    if MASK_MODE == 1:
        live = live & (tl.load(mask_ptr + offs_t[None, :] * s_mask + offs_k[:, None], mask=live, other=0) != 0)
    elif MASK_MODE == 2:
        bits = tl.load(mask_ptr + offs_k, mask=kmask, other=0)  # [BK]
        live = live & (((bits[:, None] >> offs_t[None, :]) & 1) != 0)
    return tl.where(live, h, 0.0)


@triton.jit
def _up_dot_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, idx_ptr, nact_ptr, mask_ptr, h_ptr, g_ptr,
                   T, D, K, s_x, s_up, s_gate, s_mask, s_h, D_PER,
                   ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   MASK_MODE: tl.constexpr, HAS_NACT: tl.constexpr, DOT_F32: tl.constexpr, PARTIAL: tl.constexpr,
                   TP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T > 1: h[t, k] for BK active rows and all tokens; x [T, D], h [T, K]. PARTIAL (the split
    path): program (k block, d block) adds the pre-activations over columns [pid_d * D_PER, +D_PER)
    into u = h_ptr and g_ptr [T, K] fp32 (zeroed beforehand) with atomics; _act_kernel applies the
    activation after."""
    pid, pid_d = tl.program_id(0), tl.program_id(1)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    offs_k = pid * BK + tl.arange(0, BK)  # [BK]
    kmask = offs_k < K
    rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)  # [BK]
    offs_t = tl.arange(0, TP)  # [TP]
    tmask = offs_t < T
    acc_u = tl.zeros((BK, TP), dtype=tl.float32)
    acc_g = tl.zeros((BK, TP), dtype=tl.float32)
    d_lo = pid_d * D_PER
    d_hi = tl.minimum(d_lo + D_PER, D)
    for d0 in range(d_lo, d_hi, BD):
        offs_d = d0 + tl.arange(0, BD)
        dmask = offs_d < d_hi
        xt = tl.load(x_ptr + offs_t[:, None] * s_x + offs_d[None, :],
                     mask=tmask[:, None] & dmask[None, :], other=0.0)  # [TP, BD]
        wmask = kmask[:, None] & dmask[None, :]
        wu = tl.load(up_ptr + rows[:, None] * s_up + offs_d[None, :], mask=wmask, other=0.0)  # [BK, BD]
        if DOT_F32:
            xf = tl.trans(xt.to(tl.float32))  # [BD, TP]
            acc_u = tl.dot(wu.to(tl.float32), xf, acc_u, input_precision="tf32x3")
        else:
            acc_u = tl.dot(wu, tl.trans(xt), acc_u)
        if HAS_GATE:
            wg = tl.load(gate_ptr + rows[:, None] * s_gate + offs_d[None, :], mask=wmask, other=0.0)
            if DOT_F32:
                acc_g = tl.dot(wg.to(tl.float32), tl.trans(xt.to(tl.float32)), acc_g, input_precision="tf32x3")
            else:
                acc_g = tl.dot(wg, tl.trans(xt), acc_g)
    out = offs_t[None, :] * s_h + offs_k[:, None]
    omask = kmask[:, None] & tmask[None, :]
    if PARTIAL:
        tl.atomic_add(h_ptr + out, acc_u, mask=omask, sem="relaxed")
        if HAS_GATE:
            tl.atomic_add(g_ptr + out, acc_g, mask=omask, sem="relaxed")
    else:
        h = _h_tile(acc_u, acc_g, rows, offs_k, offs_t, kmask, tmask, bias_ptr, mask_ptr, s_mask,
                    ACT, HAS_BIAS, MASK_MODE)
        tl.store(h_ptr + out, h, mask=omask)


@triton.jit
def _down_gemv_kernel(h_ptr, down_ptr, idx_ptr, nact_ptr, y_ptr, D, K, s_down,
                      HAS_NACT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T == 1: y[d] = sum_k h[k] down_t[idx[k], d] for BD columns."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    offs_d = pid * BD + tl.arange(0, BD)  # [BD]
    dmask = offs_d < D
    acc = tl.zeros((BK, BD), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)  # [BK]
        kmask = offs_k < K
        rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
        h = tl.load(h_ptr + offs_k, mask=kmask, other=0.0)  # [BK]
        live = kmask & (h != 0)  # zero activation: skip the row's bytes
        w = tl.load(down_ptr + rows[:, None] * s_down + offs_d[None, :],
                    mask=live[:, None] & dmask[None, :], other=0.0)  # [BK, BD]
        acc += h[:, None] * w.to(tl.float32)
    tl.store(y_ptr + offs_d, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _split_rows(K, SK, pid_s, BK: tl.constexpr):
    """Active rows [k_lo, k_hi) of split pid_s of SK, whole BK tiles per split."""
    per = tl.cdiv(tl.cdiv(K, SK), BK) * BK
    k_lo = pid_s * per
    return k_lo, tl.minimum(k_lo + per, K)


@triton.jit
def _act_kernel(u_ptr, g_ptr, bias_ptr, idx_ptr, nact_ptr, mask_ptr, T, K, s_h, s_mask,
                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, HAS_NACT: tl.constexpr,
                TP: tl.constexpr, BK: tl.constexpr):
    """The split path's activation (T > 1), in place: u [T, K] <- act(g, u + bias), zero where masked."""
    pid = tl.program_id(0)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    offs_k = pid * BK + tl.arange(0, BK)
    kmask = offs_k < K
    offs_t = tl.arange(0, TP)
    tmask = offs_t < T
    rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
    tk = offs_t[None, :] * s_h + offs_k[:, None]  # [BK, TP]
    tkm = kmask[:, None] & tmask[None, :]
    h = _h_tile(tl.load(u_ptr + tk, mask=tkm, other=0.0), tl.load(g_ptr + tk, mask=tkm, other=0.0), rows, offs_k,
                offs_t, kmask, tmask, bias_ptr, mask_ptr, s_mask, ACT, HAS_BIAS, MASK_MODE)
    tl.store(u_ptr + tk, h, mask=tkm)


@triton.jit
def _down_dot_kernel(h_ptr, down_ptr, idx_ptr, nact_ptr, y_ptr, T, D, K, s_down, s_h, s_y, SK,
                     HAS_NACT: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
                     TP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T > 1: y[t, d] = sum_k h[t, k] down_t[idx[k], d] for all tokens and BD columns. SPLIT:
    program (d block, k split) takes its SK-th share of the active rows and adds its partial y
    into y_ptr [T, D] fp32 (zeroed beforehand) with atomics."""
    pid, pid_s = tl.program_id(0), tl.program_id(1)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    k_lo, k_hi = _split_rows(K, SK, pid_s, BK)  # SK = 1: all rows
    offs_d = pid * BD + tl.arange(0, BD)
    dmask = offs_d < D
    offs_t = tl.arange(0, TP)
    tmask = offs_t < T
    acc = tl.zeros((TP, BD), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < k_hi
        rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
        h = tl.load(h_ptr + offs_t[:, None] * s_h + offs_k[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)  # [TP, BK]
        live = kmask & (tl.max(tl.abs(h), axis=0) > 0)  # [BK]
        w = tl.load(down_ptr + rows[:, None] * s_down + offs_d[None, :],
                    mask=live[:, None] & dmask[None, :], other=0.0)  # [BK, BD]
        acc = tl.dot(h, w.to(tl.float32), acc, input_precision=PREC)
    out = offs_t[:, None] * s_y + offs_d[None, :]
    if SPLIT:
        tl.atomic_add(y_ptr + out, acc, mask=tmask[:, None] & dmask[None, :], sem="relaxed")
    else:
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _up_partial_kernel(x_ptr, up_ptr, gate_ptr, idx_ptr, nact_ptr, u_ptr, g_ptr, D, K, s_up, s_gate, D_PER,
                       HAS_GATE: tl.constexpr, HAS_NACT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """T == 1, split D: program (k block, d block) adds the partial dot products of BK active rows
    over columns [pid_d * D_PER, +D_PER) into u [K] (and g [K]), fp32, zeroed beforehand."""
    pid_k, pid_d = tl.program_id(0), tl.program_id(1)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    offs_k = pid_k * BK + tl.arange(0, BK)
    kmask = offs_k < K
    rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
    d_lo = pid_d * D_PER
    u, g = _rows_dot_x(x_ptr, up_ptr, gate_ptr, rows, kmask, d_lo, tl.minimum(d_lo + D_PER, D), s_up, s_gate,
                       HAS_GATE, BK, BD)
    tl.atomic_add(u_ptr + offs_k, u, mask=kmask)
    if HAS_GATE:
        tl.atomic_add(g_ptr + offs_k, g, mask=kmask)


@triton.jit
def _down_split_kernel(u_ptr, g_ptr, bias_ptr, down_ptr, idx_ptr, nact_ptr, y_ptr, D, K, s_down, SK,
                       ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NACT: tl.constexpr,
                       BK: tl.constexpr, BD: tl.constexpr):
    """T == 1, split K: program (d block, k split) applies the activation to its share of the
    summed pre-activations as it loads them and adds h * down_t[idx, BD columns] into y [D] fp32
    (zeroed beforehand)."""
    pid_d, pid_s = tl.program_id(0), tl.program_id(1)
    if HAS_NACT:
        K = tl.minimum(tl.load(nact_ptr), K)
    k_lo, k_hi = _split_rows(K, SK, pid_s, BK)
    offs_d = pid_d * BD + tl.arange(0, BD)
    dmask = offs_d < D
    acc = tl.zeros((BK, BD), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < k_hi
        rows = tl.load(idx_ptr + offs_k, mask=kmask, other=0).to(tl.int64)
        u = tl.load(u_ptr + offs_k, mask=kmask, other=0.0)
        if HAS_BIAS:
            u += tl.load(bias_ptr + rows, mask=kmask, other=0.0).to(tl.float32)
        h = _act(u, tl.load(g_ptr + offs_k, mask=kmask, other=0.0), ACT)
        live = kmask & (h != 0)  # zero activation: skip the row's bytes
        w = tl.load(down_ptr + rows[:, None] * s_down + offs_d[None, :],
                    mask=live[:, None] & dmask[None, :], other=0.0)
        acc += h[:, None] * w.to(tl.float32)
    tl.atomic_add(y_ptr + offs_d, tl.sum(acc, axis=0), mask=dmask)


def sparse_ffn_split(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg: Config) -> None:
    """Through the split kernels: y [T, D] (y's dtype) = sum over active rows; masks need T > 1.
    The up stage runs cfg.up_sd programs over D per row block, adding pre-activations u, g [T, K]
    into fp32 with atomics; T == 1: the down stage applies the activation as it loads them; T > 1:
    a small kernel applies it in place first (in the down kernel's tl.dot loop it spilled
    registers: 27 vs 18 us on the H200, ncu). cfg.down_sk > 1 programs share each column block's
    rows and add into an fp32 y (then cast); T > 1 with down_sk <= 1 writes y directly. One memset
    zeroes u, g and the fp32 y."""
    T, D = x.shape
    K = idx.shape[0]
    if K == 0:
        y.zero_()
        return
    y_split = T == 1 or cfg.down_sk > 1
    n_y = T * D if y_split and y.dtype != torch.float32 else 0
    buf = torch.zeros(2 * T * K + n_y, dtype=torch.float32, device=x.device)
    u, g = buf[:T * K].view(T, K), buf[T * K:2 * T * K].view(T, K)
    y32 = buf[2 * T * K:].view(T, D) if n_y else (y.zero_() if y_split else y)
    nact = n_active if n_active is not None else idx
    if T > 1:
        launch_up(x, up, gate, up_bias, idx, mask, n_active, act, u, cfg, g=g)
        mode, mask, s_mask = _mask_args(mask, idx)
        _act_kernel[(triton.cdiv(K, 64),)](
            u, g, up_bias if up_bias is not None else u, idx, nact, mask, T, K, u.stride(0), s_mask,
            ACT=ACT_CODE[act], HAS_BIAS=up_bias is not None, MASK_MODE=mode, HAS_NACT=n_active is not None,
            TP=max(16, triton.next_power_of_2(T)), BK=64, num_warps=4)  # one compile for T <= 16, as the dot kernels
        launch_down(u, down_t, idx, n_active, y32, cfg, split=y_split)
    else:
        d_per = triton.cdiv(triton.cdiv(D, cfg.up_sd), cfg.up_bd) * cfg.up_bd
        _up_partial_kernel[(triton.cdiv(K, cfg.up_bk), triton.cdiv(D, d_per))](
            x, up, gate if gate is not None else up, idx, nact, u, g, D, K, up.stride(0),
            (gate if gate is not None else up).stride(0), d_per, HAS_GATE=gate is not None,
            HAS_NACT=n_active is not None, BK=cfg.up_bk, BD=cfg.up_bd, num_warps=cfg.up_warps)
        _down_split_kernel[(triton.cdiv(D, cfg.down_bd), cfg.down_sk)](
            u, g, up_bias if up_bias is not None else u, down_t, idx, nact, y32, D, K, down_t.stride(0),
            cfg.down_sk, ACT=ACT_CODE[act], HAS_BIAS=up_bias is not None, HAS_NACT=n_active is not None,
            BK=cfg.down_bk, BD=cfg.down_bd, num_warps=cfg.down_warps)
    if y32 is not y:
        y.copy_(y32)


@triton.jit
def _rows_tile(ptr, rows, stride, rmask, c0, D, W: tl.constexpr, CMASK: tl.constexpr):
    """[R, W] tile of the given rows, columns [c0, c0 + W) (masked to < D when CMASK)."""
    offs = c0 + tl.arange(0, W)
    m = rmask[:, None]
    if CMASK:
        m = m & (offs[None, :] < D)
    return tl.load(ptr + rows[:, None] * stride + offs[None, :], mask=m, other=0.0)


@triton.jit
def _block_rows(idx_ptr, b, kc, R: tl.constexpr):
    """Entries, their mask (< kc) and row ids of block b of R active rows (none past the end)."""
    offs = b * R + tl.arange(0, R)
    m = offs < kc
    return offs, m, tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)


@triton.jit
def _block_tiles(up_ptr, gate_ptr, down_ptr, rows, rmask, s_up, s_gate, s_down, D, HAS_GATE: tl.constexpr,
                 EAGER: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
    """A block's up, gate, down tiles of both column pieces, [R, DA] and [R, DB] (loads issued, not
    waited for). Tiles a configuration does not read (no gate, lazy down, DB = 0) are the up tile of
    that piece, unused."""
    ua = _rows_tile(up_ptr, rows, s_up, rmask, 0, D, DA, False)
    ga = ua
    da = ua
    if HAS_GATE:
        ga = _rows_tile(gate_ptr, rows, s_gate, rmask, 0, D, DA, False)
    if EAGER:
        da = _rows_tile(down_ptr, rows, s_down, rmask, 0, D, DA, False)
    ub = ua
    gb = ua
    db = ua
    if DB > 0:
        ub = _rows_tile(up_ptr, rows, s_up, rmask, DA, D, DB, True)
        gb = ub
        db = ub
        if HAS_GATE:
            gb = _rows_tile(gate_ptr, rows, s_gate, rmask, DA, D, DB, True)
        if EAGER:
            db = _rows_tile(down_ptr, rows, s_down, rmask, DA, D, DB, True)
    return ua, ga, da, ub, gb, db


@triton.jit
def _fence_gpu(v):
    """fence.acq_rel.gpu in every thread: its atomics are performed GPU-wide before what follows
    (a barrier alone orders them only within the block)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _fused_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, down_ptr, idx_ptr, nact_ptr, mask_ptr, y32_ptr, y_ptr,
                  cnt_ptr, D, K, s_up, s_gate, s_down,
                  ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr,
                  HAS_NACT: tl.constexpr, EAGER: tl.constexpr, FENCE: tl.constexpr,
                  R: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
    """T == 1, the whole FFN in one launch: each program walks blocks pid, pid + P, ... of R active
    rows; a block's up, gate (and, EAGER, down) rows are loaded whole -- as two power-of-two column
    pieces, [0, DA) and [DA, DA + DB) masked to D (DB = 0: none) -- while the previous block's
    arithmetic runs (register double buffering), and h * down accumulates in registers. At the end
    each program adds its sums into y32 [D] fp32 with atomics; the last program to take a ticket
    from cnt writes y from y32 and zeroes both again (y32 and cnt are zero on entry and exit: one
    launch, no memset, no cast kernel; calls on one stream)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    kc = K
    if HAS_NACT:
        kc = tl.minimum(tl.load(nact_ptr), K)
    nblk = tl.cdiv(kc, R)
    ca = tl.arange(0, DA)
    xa = tl.load(x_ptr + ca).to(tl.float32)
    ya = tl.zeros((DA,), tl.float32)
    offs_r, rmask, rows = _block_rows(idx_ptr, pid, kc, R)
    ua, ga, da, ub, gb, db = _block_tiles(up_ptr, gate_ptr, down_ptr, rows, rmask, s_up, s_gate, s_down, D,
                                          HAS_GATE, EAGER, DA, DB)
    if DB > 0:
        cb = DA + tl.arange(0, DB)
        xb = tl.load(x_ptr + cb, mask=cb < D, other=0.0).to(tl.float32)
        yb = tl.zeros((DB,), tl.float32)
    for b in range(pid, nblk, P):
        # the next block's rows go in flight before this block's arithmetic
        n_offs, n_rmask, n_rows = _block_rows(idx_ptr, b + P, kc, R)
        n_ua, n_ga, n_da, n_ub, n_gb, n_db = _block_tiles(up_ptr, gate_ptr, down_ptr, n_rows, n_rmask, s_up, s_gate,
                                                          s_down, D, HAS_GATE, EAGER, DA, DB)
        u = tl.sum(ua.to(tl.float32) * xa[None, :], axis=1)  # [R]
        g = tl.sum(ga.to(tl.float32) * xa[None, :], axis=1)
        if DB > 0:
            u += tl.sum(ub.to(tl.float32) * xb[None, :], axis=1)
            g += tl.sum(gb.to(tl.float32) * xb[None, :], axis=1)
        if HAS_BIAS:
            u += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        live = rmask
        if MASK_MODE == 1:
            live = live & (tl.load(mask_ptr + offs_r, mask=rmask, other=0) != 0)
        elif MASK_MODE == 2:
            live = live & ((tl.load(mask_ptr + offs_r, mask=rmask, other=0) & 1) != 0)
        h = tl.where(live, _act(u, g, ACT), 0.0)  # [R]
        if EAGER:
            ya += tl.sum(h[:, None] * da.to(tl.float32), axis=0)
            if DB > 0:
                yb += tl.sum(h[:, None] * db.to(tl.float32), axis=0)
        else:  # a zero activation's down row is not read
            dl = _rows_tile(down_ptr, rows, s_down, h != 0, 0, D, DA, False)
            ya += tl.sum(h[:, None] * dl.to(tl.float32), axis=0)
            if DB > 0:
                dlb = _rows_tile(down_ptr, rows, s_down, h != 0, DA, D, DB, True)
                yb += tl.sum(h[:, None] * dlb.to(tl.float32), axis=0)
        offs_r, rmask, rows, ua, ga, da, ub, gb, db = n_offs, n_rmask, n_rows, n_ua, n_ga, n_da, n_ub, n_gb, n_db
    if pid < nblk:
        tl.atomic_add(y32_ptr + ca, ya, sem="relaxed")
        if DB > 0:
            tl.atomic_add(y32_ptr + cb, yb, mask=cb < D, sem="relaxed")
    if FENCE:
        _fence_gpu(tl.full((1,), 0, tl.int32))
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if ticket == P - 1:  # the last program: y from the sums, scratch back to zero
        v = tl.load(y32_ptr + ca, cache_modifier=".cg")  # L2: where the atomics landed
        tl.store(y_ptr + ca, v.to(y_ptr.dtype.element_ty))
        tl.store(y32_ptr + ca, tl.zeros((DA,), tl.float32))
        if DB > 0:
            cb2 = DA + tl.arange(0, DB)
            vb = tl.load(y32_ptr + cb2, mask=cb2 < D, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + cb2, vb.to(y_ptr.dtype.element_ty), mask=cb2 < D)
            tl.store(y32_ptr + cb2, tl.zeros((DB,), tl.float32), mask=cb2 < D)
        tl.store(cnt_ptr, 0)


_FUSED_SCRATCH: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _fused_scratch(device: torch.device, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed fp32 [D] sums and the int32 ticket counter of a device; every fused call leaves
    them zero again. Shared by the calls on a device: they must be stream-ordered (one stream per
    GPU, as the runtime runs them)."""
    key = (str(device) if device.type != "cuda" or device.index is not None else f"cuda:{torch.cuda.current_device()}", D)
    if key not in _FUSED_SCRATCH:
        _FUSED_SCRATCH[key] = (torch.zeros(D, dtype=torch.float32, device=device),
                               torch.zeros(1, dtype=torch.int32, device=device))
    return _FUSED_SCRATCH[key]


def _n_sm(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def sparse_ffn_fused(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg: Config) -> None:
    """T == 1 through the fused kernel: y [1, D] (y's dtype). Grid: fused_progs programs per SM, at
    most one per block of fused_r rows."""
    D = x.shape[1]
    K = idx.shape[0]
    if K == 0:
        y.zero_()
        return
    y32, cnt = _fused_scratch(x.device, D)
    da = 1 << (D.bit_length() - 1)  # largest power of two <= D
    db = triton.next_power_of_2(D - da) if D > da else 0
    dummy = idx
    mode, mask, _ = _mask_args(mask, dummy)
    g = gate if gate is not None else up
    grid = (min(triton.cdiv(K, cfg.fused_r), cfg.fused_progs * _n_sm(x.device)),)
    _fused_kernel[grid](
        x, up, g, up_bias if up_bias is not None else dummy, down_t, idx,
        n_active if n_active is not None else dummy, mask, y32, y, cnt,
        D, K, up.stride(0), g.stride(0), down_t.stride(0), ACT=ACT_CODE[act], HAS_GATE=gate is not None,
        HAS_BIAS=up_bias is not None, MASK_MODE=mode, HAS_NACT=n_active is not None, EAGER=cfg.eager_down,
        FENCE=x.is_cuda, R=cfg.fused_r, DA=da, DB=db, num_warps=cfg.fused_warps, num_stages=1)


def _mask_args(mask: torch.Tensor | None, dummy: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """(MASK_MODE, pointer, row stride): 0 none, 1 bool [T, K] (as uint8: triton has no bool
    pointers), 2 int32 token bits [K]."""
    if mask is None:
        return 0, dummy, 0
    if mask.dtype == torch.bool:
        return 1, mask.view(torch.uint8), mask.stride(0)
    return 2, mask, 0


def launch_up(x, up, gate, up_bias, idx, mask, n_active, act, h, cfg: Config, g=None) -> None:
    """Stage 1: h [T, K] fp32 from x [T, D] and the active rows of up / gate. With g (T > 1, the
    split path): cfg.up_sd programs over D per row block add the pre-activations into h (= u) and
    g [T, K], zeroed beforehand, and the activation is left to _act_kernel."""
    T, D = x.shape
    K = idx.shape[0]
    if K == 0:
        return
    dummy = idx  # any tensor: pointer arguments the kernel never reads
    mode, mask, s_mask = _mask_args(mask, dummy)
    common = dict(ACT=ACT_CODE[act], HAS_GATE=gate is not None, HAS_BIAS=up_bias is not None,
                  MASK_MODE=mode, HAS_NACT=n_active is not None)
    ptrs = (x, up, gate if gate is not None else up, up_bias if up_bias is not None else dummy, idx,
            n_active if n_active is not None else dummy, mask, h)
    if T == 1 and not cfg.up_dot and g is None:
        grid = (triton.cdiv(K, cfg.up_bk),)
        _up_gemv_kernel[grid](*ptrs, D, K, up.stride(0), (gate if gate is not None else up).stride(0),
                              BK=cfg.up_bk, BD=cfg.up_bd, num_warps=cfg.up_warps, num_stages=cfg.up_stages, **common)
    else:
        bk = max(16, cfg.up_bk)
        tp = max(16, triton.next_power_of_2(T))
        dot_f32 = x.dtype != up.dtype or up.dtype == torch.float32
        bd = min(cfg.up_bd, 64) if dot_f32 else cfg.up_bd  # tf32x3 tiles spill registers beyond 64
        d_per = triton.cdiv(triton.cdiv(D, max(1, cfg.up_sd)), bd) * bd if g is not None else D
        _up_dot_kernel[(triton.cdiv(K, bk), triton.cdiv(D, d_per))](
            *ptrs, g if g is not None else h, T, D, K, x.stride(0), up.stride(0),
            (gate if gate is not None else up).stride(0), s_mask, h.stride(0), d_per,
            DOT_F32=dot_f32, PARTIAL=g is not None, TP=tp, BK=bk, BD=bd, num_warps=cfg.up_warps,
            num_stages=cfg.up_stages, **common)


def launch_down(h, down_t, idx, n_active, y, cfg: Config, split: bool = False) -> None:
    """Stage 2: y [T, D] (y's dtype) from h [T, K] and the active rows of down_t. split (T > 1):
    cfg.down_sk programs share each column block's rows and add into y [T, D] fp32, zeroed
    beforehand."""
    T, D = y.shape
    K = idx.shape[0]
    nact = n_active if n_active is not None else idx
    if T == 1 and not cfg.down_dot and not split:
        _down_gemv_kernel[(triton.cdiv(D, cfg.down_bd),)](
            h, down_t, idx, nact, y, D, K, down_t.stride(0), HAS_NACT=n_active is not None, BK=cfg.down_bk,
            BD=cfg.down_bd, num_warps=cfg.down_warps, num_stages=cfg.down_stages)
    else:
        tp = max(16, triton.next_power_of_2(T))
        prec = "tf32x3" if down_t.dtype == torch.float32 else "tf32"
        bd = max(16, cfg.down_bd)
        sk = max(1, cfg.down_sk) if split else 1
        _down_dot_kernel[(triton.cdiv(D, bd), sk)](
            h, down_t, idx, nact, y, T, D, K, down_t.stride(0), h.stride(0), y.stride(0), sk,
            HAS_NACT=n_active is not None, PREC=prec, SPLIT=split, TP=tp, BK=max(16, cfg.down_bk), BD=bd,
            num_warps=cfg.down_warps, num_stages=cfg.down_stages)


def sparse_ffn_triton(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active,
                      cfg: Config | None = None) -> torch.Tensor:
    """The GPU path of `sparse_ffn.sparse_ffn` (arguments already checked there)."""
    T, D = x.shape
    if up.stride(1) != 1 or down_t.stride(1) != 1 or (gate is not None and gate.stride(1) != 1):
        raise ValueError("sparse_ffn (triton): weight rows need unit column stride")
    if T > MAX_T:  # the tl.dot tiles hold all tokens: blocks of MAX_T (masks of T > 32 are bool)
        y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
        for t0 in range(0, T, MAX_T):
            sl = slice(t0, min(T, t0 + MAX_T))
            sparse_ffn_triton(x[sl], up, gate, down_t, idx, None if mask is None else mask[sl], act, up_bias,
                              y[sl], n_active, cfg)
        return y
    cfg = cfg or CONFIGS["gemv" if T == 1 else "dot"]
    x = x.contiguous()
    idx = idx if idx.is_contiguous() else idx.contiguous()
    if mask is not None:
        mask = mask.contiguous()
    if n_active is not None:
        n_active = n_active.reshape(1).to(torch.int32)
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if cfg.split and (T > 1 or mask is None):
        sparse_ffn_split(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg)
        return y
    if T == 1 and cfg.fused:
        sparse_ffn_fused(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg)
        return y
    h = torch.empty((T, max(1, idx.shape[0])), dtype=torch.float32, device=x.device)  # [T, K]
    launch_up(x, up, gate, up_bias, idx, mask, n_active, act, h, cfg)
    launch_down(h, down_t, idx, n_active, y, cfg)
    return y
