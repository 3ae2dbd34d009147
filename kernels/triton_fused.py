"""The fused Triton kernel of the sparse FFN at T == 1 (decode of one sequence): the whole FFN in
one launch (imported lazily: triton is optional).

Dimension legend: D n_embd, K active rows (idx), R rows per block, P programs.

One launch of fused_progs programs per SM (Config.fused_r > 0 selects it); each walks blocks pid,
pid + P, ... of R active rows, loading a block's whole up, gate (and, eager_down, down) rows while
the previous block's arithmetic runs, sums h * down in registers, then adds its [D] partial into
an fp32 scratch with atomics; the last program to take a ticket writes y and zeroes the scratch.
The scratch is per device: calls must be stream-ordered, as on the runtime's one stream per GPU.
One launch, no memset and no cast kernel is what makes it faster than the two stages at decode.

Quantized rows (ggml Q4_0 / Q8_0 blocks, `_fused_q_kernel`) take the same walk. A block's rows are
loaded as their raw 16-bit words, [R, NB, WB] quants and [R, NB] scales (`_q_raw`), and converted
only where they are used; a word's bytes are split into planes (Q4_0: 4 nibbles, Q8_0: 2 bytes),
each multiplied with x at its own columns (`_q_cols`) and summed in the same [NB, WB] shape, so no
tile is reshaped. Whole rows in one walk read a row's bytes contiguously; the two stages' down
stage reads 18 or 34 bytes of every row per program, which over PCIe (zero-copy rows in host
memory) is a stream of narrow reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_stages import ACT_CODE, QT_CODE, Config, _act, _block_rows, _thresholded, _w_tile, mask_args, \
    swiglu_args, w_arg


@triton.jit
def _block_tiles(up_ptr, gate_ptr, down_ptr, rows, rmask, s_up, s_gate, s_down, D, HAS_GATE: tl.constexpr,
                 EAGER: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
    """A block's up, gate, down tiles of both column pieces, [R, DA] and [R, DB] (loads issued, not
    waited for). Tiles a configuration does not read (no gate, lazy down, DB = 0) are the up tile of
    that piece, unused."""
    ua = _w_tile(up_ptr, rows, s_up, 0, D, rmask, DA, 0, False)
    ga = ua
    da = ua
    if HAS_GATE:
        ga = _w_tile(gate_ptr, rows, s_gate, 0, D, rmask, DA, 0, False)
    if EAGER:
        da = _w_tile(down_ptr, rows, s_down, 0, D, rmask, DA, 0, False)
    ub = ua
    gb = ua
    db = ua
    if DB > 0:
        ub = _w_tile(up_ptr, rows, s_up, DA, D, rmask, DB, 0, True)
        gb = ub
        db = ub
        if HAS_GATE:
            gb = _w_tile(gate_ptr, rows, s_gate, DA, D, rmask, DB, 0, True)
        if EAGER:
            db = _w_tile(down_ptr, rows, s_down, DA, D, rmask, DB, 0, True)
    return ua, ga, da, ub, gb, db


@triton.jit
def _fence_gpu(v):
    """fence.acq_rel.gpu in every thread: its atomics are performed GPU-wide before what follows
    (a barrier alone orders them only within the block)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _fused_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, down_ptr, idx_ptr, nact_ptr, mask_ptr, y32_ptr, y_ptr,
                  cnt_ptr, gpre_ptr, D, K, s_up, s_gate, s_down, thr,
                  ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr,
                  HAS_NACT: tl.constexpr, EAGER: tl.constexpr, FENCE: tl.constexpr,
                  THR: tl.constexpr, GPRE: tl.constexpr, R: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
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
        if GPRE:
            g = tl.load(gpre_ptr + rows, mask=rmask, other=0.0)
        if HAS_BIAS:
            u += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        live = rmask
        if MASK_MODE == 1:
            live = live & (tl.load(mask_ptr + offs_r, mask=rmask, other=0) != 0)
        elif MASK_MODE == 2:
            live = live & ((tl.load(mask_ptr + offs_r, mask=rmask, other=0) & 1) != 0)
        h = tl.where(live, _thresholded(_act(u, g, ACT), g, thr, THR), 0.0)  # [R]
        if EAGER:
            ya += tl.sum(h[:, None] * da.to(tl.float32), axis=0)
            if DB > 0:
                yb += tl.sum(h[:, None] * db.to(tl.float32), axis=0)
        else:  # a zero activation's down row is not read
            dl = _w_tile(down_ptr, rows, s_down, 0, D, h != 0, DA, 0, False)
            ya += tl.sum(h[:, None] * dl.to(tl.float32), axis=0)
            if DB > 0:
                dlb = _w_tile(down_ptr, rows, s_down, DA, D, h != 0, DB, 0, True)
                yb += tl.sum(h[:, None] * dlb.to(tl.float32), axis=0)
        offs_r, rmask, rows, ua, ga, da, ub, gb, db = n_offs, n_rmask, n_rows, n_ua, n_ga, n_da, n_ub, n_gb, n_db
    if pid < nblk:
        tl.atomic_add(y32_ptr + ca, ya, sem="relaxed")
        if DB > 0:
            tl.atomic_add(y32_ptr + cb, yb, mask=cb < D, sem="relaxed")
    _finish(y32_ptr, y_ptr, cnt_ptr, D, FENCE, DA, DB)


@triton.jit
def _finish(y32_ptr, y_ptr, cnt_ptr, D, FENCE: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
    """A fused program's end, after its atomics into y32: it takes a ticket from cnt, and the last
    of the P programs writes y from y32 and zeroes y32 and cnt again."""
    if FENCE:
        _fence_gpu(tl.full((1,), 0, tl.int32))
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:  # the last program: y from the sums, scratch back to zero
        ca = tl.arange(0, DA)
        v = tl.load(y32_ptr + ca, cache_modifier=".cg")  # L2: where the atomics landed
        tl.store(y_ptr + ca, v.to(y_ptr.dtype.element_ty))
        tl.store(y32_ptr + ca, tl.zeros((DA,), tl.float32))
        if DB > 0:
            cb = DA + tl.arange(0, DB)
            vb = tl.load(y32_ptr + cb, mask=cb < D, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + cb, vb.to(y_ptr.dtype.element_ty), mask=cb < D)
            tl.store(y32_ptr + cb, tl.zeros((DB,), tl.float32), mask=cb < D)
        tl.store(cnt_ptr, 0)


@triton.jit
def _q_raw(ptr, rows, stride, b0, nblk, rmask, NB: tl.constexpr, QT: tl.constexpr):
    """The raw loads of blocks b0 .. b0 + NB - 1 (masked to < nblk) of quantized rows `rows` [R]
    (rmask [R]; ptr and stride as `w_arg` gives them: int16 words): quants [R, NB, WB] and f16
    scales [R, NB] as int16 words (issued, not converted: `_q_plane`, `_q_scale`)."""
    WB: tl.constexpr = 8 * QT  # words of quants per block (Q4_0: 8, Q8_0: 16), after the scale word
    b = b0 + tl.arange(0, NB)
    bm = rmask[:, None] & (b < nblk)[None, :]  # [R, NB]
    blk = ptr + rows[:, None] * stride + (b * (WB + 1))[None, :]  # [R, NB] scale words
    d = tl.load(blk, mask=bm, other=0)
    v = tl.load(blk[:, :, None] + 1 + tl.arange(0, WB)[None, None, :], mask=bm[:, :, None], other=0)
    return v, d


@triton.jit
def _q_scale(d):
    return d.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q_plane(v, QT: tl.constexpr, k: tl.constexpr):
    """The values of plane k of quant words v (fp32, v's shape): Q4_0 (QT 1) word j holds bytes 2j,
    2j + 1 and plane k its byte k % 2's low (k < 2) or high nibble, minus 8; Q8_0 (QT 2) plane k its
    byte k as int8."""
    w = v.to(tl.int32) & 0xFFFF
    if QT == 1:
        q = ((w >> (8 * (k % 2) + 4 * (k // 2))) & 15) - 8
    else:
        q = (((w >> (8 * k)) & 255) ^ 128) - 128
    return q.to(tl.float32)


@triton.jit
def _q_cols(b0, NB: tl.constexpr, QT: tl.constexpr, k: tl.constexpr):
    """[NB, WB] the columns of plane k of blocks b0 .. b0 + NB - 1: 32 b + 2 j + k % 2 + 16 (k // 2)
    (Q4_0: a byte's low nibble is its block's column, the high one that column + 16) or 32 b + 2 j
    + k (Q8_0)."""
    WB: tl.constexpr = 8 * QT
    c = 32 * (b0 + tl.arange(0, NB))[:, None] + 2 * tl.arange(0, WB)[None, :]
    if QT == 1:
        c += k % 2 + 16 * (k // 2)
    else:
        c += k
    return c


@triton.jit
def _q_x(x_ptr, b0, nblk, NB: tl.constexpr, QT: tl.constexpr, k: tl.constexpr):
    """[NB, WB] fp32 x at plane k's columns (zero past block nblk)."""
    c = _q_cols(b0, NB, QT, k)
    return tl.load(x_ptr + c, mask=c < 32 * nblk, other=0.0).to(tl.float32)


@triton.jit
def _q_dot(v, d, x_ptr, b0, nblk, NB: tl.constexpr, QT: tl.constexpr):
    """[R] the rows (raw blocks v, d of `_q_raw`) dotted with x over their NB blocks from b0."""
    s = _q_plane(v, QT, 0) * _q_x(x_ptr, b0, nblk, NB, QT, 0)[None] + \
        _q_plane(v, QT, 1) * _q_x(x_ptr, b0, nblk, NB, QT, 1)[None]
    if QT == 1:
        s += _q_plane(v, QT, 2) * _q_x(x_ptr, b0, nblk, NB, QT, 2)[None] + \
            _q_plane(v, QT, 3) * _q_x(x_ptr, b0, nblk, NB, QT, 3)[None]
    return tl.sum(tl.sum(s, axis=2) * _q_scale(d), axis=1)


@triton.jit
def _q_axpy(y0, y1, y2, y3, h, v, d, QT: tl.constexpr):
    """The planes' sums [NB, WB] plus h [R] times the rows (raw blocks v, d) (y2, y3: Q4_0 only)."""
    hd = (h[:, None] * _q_scale(d))[:, :, None]  # [R, NB, 1]
    y0 += tl.sum(hd * _q_plane(v, QT, 0), axis=0)
    y1 += tl.sum(hd * _q_plane(v, QT, 1), axis=0)
    if QT == 1:
        y2 += tl.sum(hd * _q_plane(v, QT, 2), axis=0)
        y3 += tl.sum(hd * _q_plane(v, QT, 3), axis=0)
    return y0, y1, y2, y3


@triton.jit
def _q_add(y32_ptr, y0, y1, y2, y3, b0, nblk, NB: tl.constexpr, QT: tl.constexpr):
    """The planes' sums added into y32 [D] with atomics, joined first into the blocks' column order
    (one contiguous run of NB * 32 columns from 32 b0: atomics of adjacent addresses)."""
    if QT == 1:  # planes 0, 1: columns 2j, 2j + 1 of the low 16; planes 2, 3 of the high 16
        lo = tl.reshape(tl.join(y0, y1), (NB, 16))
        hi = tl.reshape(tl.join(y2, y3), (NB, 16))
        y = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (NB * 32,))
    else:
        y = tl.reshape(tl.join(y0, y1), (NB * 32,))
    c = 32 * b0 + tl.arange(0, NB * 32)
    tl.atomic_add(y32_ptr + c, y, mask=c < 32 * nblk, sem="relaxed")


@triton.jit
def _q_tiles(up_ptr, gate_ptr, down_ptr, rows, rmask, s_up, s_gate, s_down, b0, nblk,
             HAS_GATE: tl.constexpr, EAGER: tl.constexpr, NB: tl.constexpr, QT: tl.constexpr):
    """A block's raw up, gate, down blocks NB from b0 (`_q_raw`; loads issued, not waited for);
    those a configuration does not read are the up blocks, unused."""
    uv, ud = _q_raw(up_ptr, rows, s_up, b0, nblk, rmask, NB, QT)
    gv, gd, dv, dd = uv, ud, uv, ud
    if HAS_GATE:
        gv, gd = _q_raw(gate_ptr, rows, s_gate, b0, nblk, rmask, NB, QT)
    if EAGER:
        dv, dd = _q_raw(down_ptr, rows, s_down, b0, nblk, rmask, NB, QT)
    return uv, ud, gv, gd, dv, dd


@triton.jit
def _fused_q_kernel(x_ptr, up_ptr, gate_ptr, bias_ptr, down_ptr, idx_ptr, nact_ptr, mask_ptr, y32_ptr, y_ptr,
                    cnt_ptr, gpre_ptr, D, K, s_up, s_gate, s_down, thr,
                    ACT: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr,
                    HAS_NACT: tl.constexpr, EAGER: tl.constexpr, FENCE: tl.constexpr, THR: tl.constexpr,
                    GPRE: tl.constexpr, QT: tl.constexpr, R: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr):
    """`_fused_kernel` on quantized rows (QT 1 q4_0, QT 2 q8_0): a row's blocks as two power-of-two
    pieces, NA blocks from 0 and NB from NA (masked to D / 32 blocks; NB = 0: none); the planes'
    sums of h * down stay in registers [NA | NB, WB] until the atomics."""
    WB: tl.constexpr = 8 * QT
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    nblk = D // 32
    kc = K
    if HAS_NACT:
        kc = tl.minimum(tl.load(nact_ptr), K)
    nrb = tl.cdiv(kc, R)
    a0 = tl.zeros((NA, WB), tl.float32)
    a1, a2, a3 = a0, a0, a0
    NBX: tl.constexpr = NB if NB > 0 else 1  # the second piece's shapes (unused when NB == 0)
    b0 = tl.zeros((NBX, WB), tl.float32)
    b1, b2, b3 = b0, b0, b0
    offs_r, rmask, rows = _block_rows(idx_ptr, pid, kc, R)
    uv, ud, gv, gd, dv, dd = _q_tiles(up_ptr, gate_ptr, down_ptr, rows, rmask, s_up, s_gate, s_down, 0, nblk,
                                      HAS_GATE, EAGER, NA, QT)
    uvb, udb, gvb, gdb, dvb, ddb = _q_tiles(up_ptr, gate_ptr, down_ptr, rows, rmask & (NB > 0), s_up, s_gate,
                                            s_down, NA, nblk, HAS_GATE, EAGER, NBX, QT)
    for blk in range(pid, nrb, P):
        # the next block's rows go in flight before this block's arithmetic
        n_offs, n_rmask, n_rows = _block_rows(idx_ptr, blk + P, kc, R)
        n_uv, n_ud, n_gv, n_gd, n_dv, n_dd = _q_tiles(up_ptr, gate_ptr, down_ptr, n_rows, n_rmask, s_up, s_gate,
                                                      s_down, 0, nblk, HAS_GATE, EAGER, NA, QT)
        n_uvb, n_udb, n_gvb, n_gdb, n_dvb, n_ddb = _q_tiles(up_ptr, gate_ptr, down_ptr, n_rows, n_rmask & (NB > 0),
                                                            s_up, s_gate, s_down, NA, nblk, HAS_GATE, EAGER, NBX, QT)
        u = _q_dot(uv, ud, x_ptr, 0, nblk, NA, QT)  # [R]
        g = u
        if HAS_GATE:
            g = _q_dot(gv, gd, x_ptr, 0, nblk, NA, QT)
        if NB > 0:
            u += _q_dot(uvb, udb, x_ptr, NA, nblk, NBX, QT)
            if HAS_GATE:
                g += _q_dot(gvb, gdb, x_ptr, NA, nblk, NBX, QT)
        if GPRE:
            g = tl.load(gpre_ptr + rows, mask=rmask, other=0.0)
        if HAS_BIAS:
            u += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        live = rmask
        if MASK_MODE == 1:
            live = live & (tl.load(mask_ptr + offs_r, mask=rmask, other=0) != 0)
        elif MASK_MODE == 2:
            live = live & ((tl.load(mask_ptr + offs_r, mask=rmask, other=0) & 1) != 0)
        h = tl.where(live, _thresholded(_act(u, g, ACT), g, thr, THR), 0.0)  # [R]
        if not EAGER:  # a zero activation's down row is not read
            dv, dd = _q_raw(down_ptr, rows, s_down, 0, nblk, h != 0, NA, QT)
            if NB > 0:
                dvb, ddb = _q_raw(down_ptr, rows, s_down, NA, nblk, h != 0, NBX, QT)
        a0, a1, a2, a3 = _q_axpy(a0, a1, a2, a3, h, dv, dd, QT)
        if NB > 0:
            b0, b1, b2, b3 = _q_axpy(b0, b1, b2, b3, h, dvb, ddb, QT)
        offs_r, rmask, rows = n_offs, n_rmask, n_rows
        uv, ud, gv, gd, dv, dd = n_uv, n_ud, n_gv, n_gd, n_dv, n_dd
        uvb, udb, gvb, gdb, dvb, ddb = n_uvb, n_udb, n_gvb, n_gdb, n_dvb, n_ddb
    if pid < nrb:
        _q_add(y32_ptr, a0, a1, a2, a3, 0, nblk, NA, QT)
        if NB > 0:
            _q_add(y32_ptr, b0, b1, b2, b3, NA, nblk, NBX, QT)
    _finish(y32_ptr, y_ptr, cnt_ptr, D, FENCE, 32 * NA, 32 * NB)


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


def sparse_ffn_fused(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg: Config, *,
                     qtype: str | None = None, act_threshold: float | None = None, act_on: str = "gate",
                     gate_pre: torch.Tensor | None = None) -> None:
    """T == 1 through the fused kernel, on float rows or quantized ones (qtype): y [1, D] (y's
    dtype). Grid: fused_progs programs per SM, at most one per block of fused_r rows. The SwiGLU
    options as sparse_ffn takes them (gate_pre: the gate rows are not read)."""
    D = x.shape[1]
    K = idx.shape[0]
    if K == 0:
        y.zero_()
        return
    y32, cnt = _fused_scratch(x.device, D)
    unit = 1 if qtype is None else 32  # a piece's width counts columns, or blocks of 32
    n = D // unit
    pa = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    pb = triton.next_power_of_2(n - pa) if n > pa else 0
    dummy = idx
    mode, mask, _ = mask_args(mask, dummy)
    sw, gp, _, thr = swiglu_args(act_threshold, act_on, gate_pre, dummy)
    (up_w, s_up), (down_w, s_down) = w_arg(up, qtype), w_arg(down_t, qtype)
    gate_w, s_gate = w_arg(gate, qtype) if gate is not None else (up_w, s_up)
    grid = (min(triton.cdiv(K, cfg.fused_r), cfg.fused_progs * _n_sm(x.device)),)
    args = (x, up_w, gate_w, up_bias if up_bias is not None else dummy, down_w, idx,
            n_active if n_active is not None else dummy, mask, y32, y, cnt, gp, D, K, s_up, s_gate, s_down, thr)
    common = dict(ACT=ACT_CODE[act], HAS_GATE=gate is not None and gate_pre is None, HAS_BIAS=up_bias is not None,
                  MASK_MODE=mode, HAS_NACT=n_active is not None, EAGER=cfg.eager_down, FENCE=x.is_cuda,
                  R=cfg.fused_r, num_warps=cfg.fused_warps, num_stages=1, **sw)
    if qtype is None:
        _fused_kernel[grid](*args, DA=pa, DB=pb, **common)
    else:
        _fused_q_kernel[grid](*args, QT=QT_CODE[qtype], NA=pa, NB=pb, **common)
