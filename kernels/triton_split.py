"""Triton kernels of `predictor.split_active_packed` (threshold, token bitmask, GPU/CPU split and
compaction in one launch, no host sync) and `predictor.pack_active_bits` (imported lazily:
triton is optional).

Dimension legend: T tokens (<= 32), TP = T padded to a power of two, N neurons, BN neurons of a
program, PB neurons per step of its prefix count, C capacity of a part.

Split grid (2, ceil(N / BN)): program (p, c) writes part p's (0: GPU, 1: CPU) selected neurons of
chunk c at their slots: it counts the part's selections in chunks 0..c-1 itself (a sum, no scan:
the logits are a few KB per token and sit in L2), then an in-block cumsum places its own. The
output is in ascending order and deterministic, with no zero-filled buffer. Part 0's programs also
add the decode step's counters where asked: each neuron's active tokens (``activity``) and the part's
(token, neuron) pairs and rows (``stats``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BN = 1024  # neurons of a program (13824 neurons: 14 chunks)


@triton.jit
def _active(logits_ptr, offs_t, offs_n, tmask, nmask, s_l, thr, SILU: tl.constexpr):
    lg = tl.load(logits_ptr + offs_t[:, None] * s_l + offs_n[None, :],
                 mask=tmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
    if SILU:  # gate values: |SiLU(g)| > thr (SwiGLU gate-first)
        act = tl.abs(lg / (1.0 + tl.exp(-lg))) > thr
    else:
        act = lg >= thr
    return act & tmask[:, None] & nmask[None, :]


@triton.jit
def _split_pack_kernel(logits_ptr, gpu_mask_ptr, local_ptr, out_ptr, act_ptr, stats_ptr, T, N, s_l, thr, cap_g,
                       cap_c, HAS_LOCAL: tl.constexpr, SILU: tl.constexpr, HAS_ACT: tl.constexpr,
                       HAS_STATS: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr, PB: tl.constexpr):
    part = tl.program_id(0)  # 0: GPU neurons, 1: CPU neurons
    c = tl.program_id(1)
    base = part * (1 + 2 * cap_g)
    cap = tl.where(part == 0, cap_g, cap_c)
    offs_t = tl.arange(0, TP)  # [TP]
    tmask = offs_t < T
    n_lo = c * BN
    count = tl.full((), 0, tl.int32)  # the part's selections before this chunk
    for n0 in range(0, n_lo, PB):
        offs = n0 + tl.arange(0, PB)
        m = offs < n_lo
        any_t = tl.max(_active(logits_ptr, offs_t, offs, tmask, m, s_l, thr, SILU).to(tl.int32), axis=0)  # [PB]
        on_gpu = tl.load(gpu_mask_ptr + offs, mask=m, other=0) != 0
        count += tl.sum(((any_t != 0) & (on_gpu == (part == 0)) & m).to(tl.int32), axis=0)
    offs_n = n_lo + tl.arange(0, BN)  # [BN]
    nmask = offs_n < N
    act = _active(logits_ptr, offs_t, offs_n, tmask, nmask, s_l, thr, SILU)  # [TP, BN]
    bits = tl.sum(act.to(tl.int32) << offs_t[:, None], axis=0)  # [BN] int32, disjoint bits
    on_gpu = tl.load(gpu_mask_ptr + offs_n, mask=nmask, other=0) != 0
    sel = (bits != 0) & (on_gpu == (part == 0)) & nmask
    seli = sel.to(tl.int32)
    pos = count + tl.cumsum(seli, axis=0) - 1  # [BN] slot of each selected neuron
    ok = sel & (pos < cap)
    if HAS_LOCAL:
        ids = tl.load(local_ptr + offs_n, mask=nmask, other=0).to(tl.int32)
    else:
        ids = offs_n.to(tl.int32)
    tl.store(out_ptr + base + 1 + pos, ids, mask=ok)
    tl.store(out_ptr + base + 1 + cap + pos, bits, mask=ok)
    total = count + tl.sum(seli, axis=0)
    if c == tl.num_programs(1) - 1:
        tl.store(out_ptr + base, total)
    if part == 0:
        tokens = tl.sum(act.to(tl.int64), axis=0)  # [BN] active tokens of every neuron of the chunk
        if HAS_ACT:
            a = tl.load(act_ptr + offs_n, mask=nmask, other=0)
            tl.store(act_ptr + offs_n, a + tokens, mask=nmask)
        if HAS_STATS:
            tl.atomic_add(stats_ptr, tl.sum(tl.where(sel, tokens, 0), axis=0))
            if c == tl.num_programs(1) - 1:
                tl.atomic_add(stats_ptr + 1, total.to(tl.int64))


def split_pack(logits: torch.Tensor, threshold: float, gpu_mask: torch.Tensor, local_of: torch.Tensor | None,
               cap_g: int, cap_c: int, bn: int | None = None, num_warps: int = 4, silu: bool = False,
               activity: torch.Tensor | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [(1 + 2 cap_g) + (1 + 2 cap_c)]: the GPU part then the CPU part (see predictor.py).
    Slots past a part's count are left unwritten (garbage): readers use the count. silu: the
    logits are gate values, active iff |SiLU(g)| > threshold. activity: int64 [N] += each
    neuron's active tokens; stats: int64 [2] += the GPU part's (token, neuron) pairs and rows."""
    T, N = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(2 + 2 * cap_g + 2 * cap_c, dtype=torch.int32, device=logits.device)
    gm = gpu_mask.contiguous().view(torch.uint8)
    loc = local_of.contiguous() if local_of is not None else gm
    tp = max(2, triton.next_power_of_2(T))
    pb = max(16, min(8192, 32768 // tp))  # a prefix step's [TP, PB] tile: at most 32K values
    bn = bn or min(BN, pb)
    n_chunks = max(1, triton.cdiv(N, bn))
    dummy = out.view(torch.int64)[:0] if activity is None or stats is None else None
    _split_pack_kernel[(2, n_chunks)](
        logits, gm, loc, out, activity if activity is not None else dummy, stats if stats is not None else dummy,
        T, N, logits.stride(0), float(threshold), cap_g, cap_c, HAS_LOCAL=local_of is not None, SILU=silu,
        HAS_ACT=activity is not None, HAS_STATS=stats is not None, TP=tp, BN=bn, PB=pb, num_warps=num_warps)
    return out


@triton.jit
def _pack_bits_kernel(logits_ptr, skip_ptr, out_ptr, s_l, s_o, col0, n, thr, HAS_SKIP: tl.constexpr,
                      BY: tl.constexpr):
    b = tl.program_id(0)
    offs_byte = tl.program_id(1) * BY + tl.arange(0, BY)  # [BY]
    bit = tl.arange(0, 8)  # [8]
    j = offs_byte[:, None] * 8 + bit[None, :]  # [BY, 8] neuron of each bit
    m = j < n
    lg = tl.load(logits_ptr + b * s_l + col0 + j, mask=m, other=0.0).to(tl.float32)
    on = (lg >= thr) & m
    if HAS_SKIP:
        on = on & (tl.load(skip_ptr + j, mask=m, other=0) == 0)
    byte = tl.sum(on.to(tl.int32) << bit[None, :], axis=1)  # [BY], disjoint bits
    tl.store(out_ptr + b * s_o + offs_byte, byte.to(tl.uint8), mask=offs_byte < (n + 7) // 8)


def pack_bits(logits: torch.Tensor, threshold: float, col0: int, n: int, skip: torch.Tensor | None = None,
              by: int = 256, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [T, ceil(n/8)]: bit j % 8 of byte j // 8 set iff logits[t, col0 + j] >= threshold
    (fp32 compare) and not skip[j], one launch, into out when given (see predictor.pack_active_bits)."""
    T = logits.shape[0]
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    nb = (n + 7) // 8
    out = torch.empty(T, nb, dtype=torch.uint8, device=logits.device) if out is None else out
    sk = skip.contiguous().view(torch.uint8) if skip is not None else out
    _pack_bits_kernel[(T, triton.cdiv(nb, by))](logits, sk, out, logits.stride(0), nb, col0, n, float(threshold),
                                                HAS_SKIP=skip is not None, BY=by, num_warps=4)
    return out
