"""Triton kernel of `predictor.split_active_packed`: threshold, token bitmask, GPU/CPU split and
compaction in one launch, no host sync (imported lazily: triton is optional).

Dimension legend: T tokens (<= 32), TP = T padded to a power of two, N neurons, BN neurons per
step, C capacity of a part.

Grid (2,): program 0 writes the GPU part, program 1 the CPU part, each walking N in steps of BN
and appending the selected ids in ascending order (an in-block cumsum plus a running count), so
the output is deterministic and needs no atomics and no zero-filled buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BN = 4096  # neurons per step: few long steps (each a cumsum and a running count) beat many short ones


@triton.jit
def _split_pack_kernel(logits_ptr, gpu_mask_ptr, local_ptr, out_ptr, T, N, s_l, thr, cap_g, cap_c,
                       HAS_LOCAL: tl.constexpr, SILU: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr):
    part = tl.program_id(0)  # 0: GPU neurons, 1: CPU neurons
    base = part * (1 + 2 * cap_g)
    cap = tl.where(part == 0, cap_g, cap_c)
    offs_t = tl.arange(0, TP)  # [TP]
    tmask = offs_t < T
    count = tl.full((), 0, tl.int32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)  # [BN]
        nmask = offs_n < N
        lg = tl.load(logits_ptr + offs_t[:, None] * s_l + offs_n[None, :],
                     mask=tmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)  # [TP, BN]
        if SILU:  # gate values: |SiLU(g)| > thr (SwiGLU gate-first)
            act = tl.abs(lg / (1.0 + tl.exp(-lg))) > thr
        else:
            act = lg >= thr
        act = act & tmask[:, None] & nmask[None, :]
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
        count += tl.sum(seli, axis=0)
    tl.store(out_ptr + base, count)


def split_pack(logits: torch.Tensor, threshold: float, gpu_mask: torch.Tensor, local_of: torch.Tensor | None,
               cap_g: int, cap_c: int, bn: int | None = None, num_warps: int = 8, silu: bool = False) -> torch.Tensor:
    """int32 [(1 + 2 cap_g) + (1 + 2 cap_c)]: the GPU part then the CPU part (see predictor.py).
    Slots past a part's count are left unwritten (garbage): readers use the count. silu: the
    logits are gate values, active iff |SiLU(g)| > threshold."""
    T, N = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(2 + 2 * cap_g + 2 * cap_c, dtype=torch.int32, device=logits.device)
    gm = gpu_mask.contiguous().view(torch.uint8)
    loc = local_of.contiguous() if local_of is not None else gm
    tp = max(2, triton.next_power_of_2(T))
    bn = bn or min(BN, 32768 // tp)  # a [TP, BN] tile of at most 32K values (no register spills)
    _split_pack_kernel[(2,)](logits, gm, loc, out, T, N, logits.stride(0), float(threshold), cap_g, cap_c,
                             HAS_LOCAL=local_of is not None, SILU=silu, TP=tp, BN=bn, num_warps=num_warps)
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
              by: int = 256) -> torch.Tensor:
    """uint8 [T, ceil(n/8)]: bit j % 8 of byte j // 8 set iff logits[t, col0 + j] >= threshold
    (fp32 compare) and not skip[j], one launch (see predictor.pack_active_bits)."""
    T = logits.shape[0]
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    nb = (n + 7) // 8
    out = torch.empty(T, nb, dtype=torch.uint8, device=logits.device)
    sk = skip.contiguous().view(torch.uint8) if skip is not None else out
    _pack_bits_kernel[(T, triton.cdiv(nb, by))](logits, sk, out, logits.stride(0), nb, col0, n, float(threshold),
                                                HAS_SKIP=skip is not None, BY=by, num_warps=4)
    return out
