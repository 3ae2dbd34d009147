"""Triton decode attention over a slotted KV cache, with slots and positions read on the device
(imported lazily: triton is optional).

Dimension legend: B sequences (one new token each), Hs query heads, Gs KV groups, NG = Hs / Gs
query heads per group, NGP = NG padded for tl.dot (>= 16), hd head_dim, BL keys per step.

Grid (B, Gs): a program serves the NG query heads of one KV group of one sequence, so each K/V
row is read once per group (GQA without copies). It walks the keys 0 .. pos[b] of cache slot
slots[b] in blocks of BL with an online softmax (fp32 statistics and accumulator). The key
count comes from device memory, so a CUDA graph captured once serves every position: the
decode step needs no host sync and no per-length re-capture.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr,
                        s_qb, s_cs, s_cg, s_cp, scale,
                        NG: tl.constexpr, NGP: tl.constexpr, HD: tl.constexpr, BL: tl.constexpr,
                        IEEE: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    n_keys = tl.load(pos_ptr + b).to(tl.int32) + 1
    offs_h = tl.arange(0, NGP)  # [NGP] query heads of the group (padded)
    offs_d = tl.arange(0, HD)  # [HD]
    hmask = offs_h < NG
    q_rows = q_ptr + b * s_qb + (g * NG + offs_h)[:, None] * HD + offs_d[None, :]
    q = tl.load(q_rows, mask=hmask[:, None], other=0.0)  # [NGP, HD]
    base = slot * s_cs + g * s_cg
    m_i = tl.full((NGP,), float("-inf"), tl.float32)
    l_i = tl.zeros((NGP,), tl.float32)
    acc = tl.zeros((NGP, HD), tl.float32)
    for start in range(0, n_keys, BL):
        offs_k = start + tl.arange(0, BL)  # [BL]
        kmask = offs_k < n_keys
        kv_off = base + offs_k[:, None] * s_cp + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kmask[:, None], other=0.0)  # [BL, HD]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [NGP, BL] fp32
        s = tl.where(kmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kmask[:, None], other=0.0)  # [BL, HD]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + b * s_qb + (g * NG + offs_h)[:, None] * HD + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, pos: torch.Tensor, scale: float, block: int = 64) -> torch.Tensor:
    """o [B, Hs, hd] (q's dtype): softmax(q . K[slot, :pos+1]^T * scale) . V per query head.
    q [B, Hs, hd]; caches [S_slots, Gs, S_max, hd] (q's dtype); slots, pos [B] int on the device."""
    B, Hs, hd = q.shape
    Gs = k_cache.shape[1]
    ng = Hs // Gs
    q = q.contiguous()
    o = torch.empty_like(q)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches must share a row-major layout"
    _decode_attn_kernel[(B, Gs)](q, k_cache, v_cache, slots, pos, o, q.stride(0), k_cache.stride(0),
                                 k_cache.stride(1), k_cache.stride(2), float(scale),
                                 NG=ng, NGP=max(16, triton.next_power_of_2(ng)), HD=hd, BL=block,
                                 IEEE=q.dtype == torch.float32, num_warps=4)
    return o


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, s_qkv, s_cs, s_q,
                       s_c0, s_c1, s_c2, Hs, Gs, n_rot, ROPE: tl.constexpr, NEOX: tl.constexpr, HD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # a head of q, then of k, then of v
    d = tl.arange(0, HD)
    row = qkv_ptr + b * s_qkv + h * HD
    x = tl.load(row + d).to(tl.float32)
    if ROPE:  # q and k heads: the first n_rot dims rotate, the rest pass
        rot = (d < n_rot) & (h < Hs + Gs)
        half = n_rot // 2
        if NEOX:  # halves: (x[j], x[j + n_rot/2])
            lo = d < half
            partner = tl.where(lo, d + half, d - half)
            j = tl.where(lo, d, d - half)
            sign = tl.where(lo, -1.0, 1.0)
        else:  # adjacent pairs: (x[2j], x[2j+1])
            partner = d ^ 1
            j = d // 2
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        xp = tl.load(row + partner, mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + b * s_cs + j, mask=rot, other=1.0)
        s = tl.load(sin_ptr + b * s_cs + j, mask=rot, other=0.0)
        x = tl.where(rot, x * c + sign * xp * s, x)
    slot = tl.load(slot_ptr + b)
    p = tl.load(pos_ptr + b)
    if h < Hs:
        tl.store(q_ptr + b * s_q + h * HD + d, x.to(q_ptr.dtype.element_ty))
    elif h < Hs + Gs:
        tl.store(k_ptr + slot * s_c0 + (h - Hs) * s_c1 + p * s_c2 + d, x.to(k_ptr.dtype.element_ty))
    else:
        tl.store(v_ptr + slot * s_c0 + (h - Hs - Gs) * s_c1 + p * s_c2 + d, x.to(v_ptr.dtype.element_ty))


def rope_cache_triton(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, style: str | None,
                      n_rot: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      pos: torch.Tensor, Hs: int, Gs: int) -> torch.Tensor:
    """The decode token's rotary embedding and KV-cache write in one launch (grid (B, Hs + 2 Gs),
    a head a program): q [B, Hs, hd] rotated (qkv's dtype); K rotated and V written at pos[b] of
    slot slots[b]. qkv [B, (Hs + 2 Gs) * hd]; cos, sin [B, n_rot / 2] fp32 (None with style None)."""
    B = qkv.shape[0]
    hd = k_cache.shape[3]
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    q = torch.empty(B, Hs, hd, dtype=qkv.dtype, device=qkv.device)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches must share a row-major layout"
    rope = style is not None
    cs = cos if rope else q  # unread without rope
    _rope_cache_kernel[(B, Hs + 2 * Gs)](qkv, cs, sin if rope else q, slots, pos, q, k_cache, v_cache,
                                        qkv.stride(0), cs.stride(0), q.stride(0), k_cache.stride(0),
                                        k_cache.stride(1), k_cache.stride(2), Hs, Gs, n_rot, ROPE=rope,
                                        NEOX=style == "neox", HD=hd, num_warps=1)
    return q
