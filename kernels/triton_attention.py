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
