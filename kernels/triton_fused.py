"""The fused Triton kernel of the sparse FFN at T == 1 (decode of one sequence): the whole FFN in
one launch (imported lazily: triton is optional).

Dimension legend: D n_embd, K active rows (idx), R rows per block, P programs.

One launch of fused_progs programs per SM (Config.fused_r > 0 selects it); each walks blocks pid,
pid + P, ... of R active rows, loading a block's whole up, gate (and, eager_down, down) rows while
the previous block's arithmetic runs, sums h * down in registers, then adds its [D] partial into
an fp32 scratch with atomics; the last program to take a ticket writes y and zeroes the scratch.
The scratch is per device: calls must be stream-ordered, as on the runtime's one stream per GPU.
One launch, no memset and no cast kernel is what makes it faster than the two stages at decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_stages import ACT_CODE, Config, _act, _block_rows, _thresholded, _w_tile, mask_args, swiglu_args


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
    if FENCE:
        _fence_gpu(tl.full((1,), 0, tl.int32))
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if ticket == P - 1:  # the last program: y from the sums, scratch back to zero
        v = tl.load(y32_ptr + ca, cache_modifier=".cg")  # L2: where the atomics landed
        tl.store(y_ptr + ca, v.to(y_ptr.dtype.element_ty))
        tl.store(y32_ptr + ca, tl.zeros((DA,), tl.float32))
        if DB > 0:
            vb = tl.load(y32_ptr + cb, mask=cb < D, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + cb, vb.to(y_ptr.dtype.element_ty), mask=cb < D)
            tl.store(y32_ptr + cb, tl.zeros((DB,), tl.float32), mask=cb < D)
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


def sparse_ffn_fused(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg: Config, *,
                     act_threshold: float | None = None, act_on: str = "gate",
                     gate_pre: torch.Tensor | None = None) -> None:
    """T == 1 through the fused kernel, on float rows: y [1, D] (y's dtype). Grid: fused_progs
    programs per SM, at most one per block of fused_r rows. The SwiGLU options as sparse_ffn takes
    them (gate_pre: the gate rows are not read)."""
    D = x.shape[1]
    K = idx.shape[0]
    if K == 0:
        y.zero_()
        return
    y32, cnt = _fused_scratch(x.device, D)
    da = 1 << (D.bit_length() - 1)  # largest power of two <= D
    db = triton.next_power_of_2(D - da) if D > da else 0
    dummy = idx
    mode, mask, _ = mask_args(mask, dummy)
    sw, gp, _, thr = swiglu_args(act_threshold, act_on, gate_pre, dummy)
    gate_w = gate if gate is not None else up
    grid = (min(triton.cdiv(K, cfg.fused_r), cfg.fused_progs * _n_sm(x.device)),)
    _fused_kernel[grid](
        x, up, gate_w, up_bias if up_bias is not None else dummy, down_t, idx,
        n_active if n_active is not None else dummy, mask, y32, y, cnt, gp,
        D, K, up.stride(0), gate_w.stride(0), down_t.stride(0), thr, ACT=ACT_CODE[act],
        HAS_GATE=gate is not None and gate_pre is None, HAS_BIAS=up_bias is not None, MASK_MODE=mode,
        HAS_NACT=n_active is not None, EAGER=cfg.eager_down, FENCE=x.is_cuda, R=cfg.fused_r,
        DA=da, DB=db, num_warps=cfg.fused_warps, num_stages=1, **sw)
