"""Attention over a shard of heads, with rotary embedding and a slotted KV cache.

Dimension legend:
  B sequences in the batch   T new tokens per sequence   D n_embd   hd head_dim
  Hs query heads of the shard   Gs KV-head groups of the shard (GQA: query head h uses group
  h // (Hs / Gs))   S_slots cache slots   S_max cache length   L keys attended (max length)

A shard holds whole KV groups and their query heads: rows of wq / wk / wv and the matching rows
of wo_t (the transposed output projection), and its own KV cache. Its output is the PARTIAL
output projection: the outputs of disjoint head shards add up to the full attention output
(the output bias, if any, is added once by the merge).

Sequence b writes its new K/V at positions start_pos[b] .. start_pos[b]+T-1 of cache slot
slots[b] and attends causally to positions 0 .. start_pos[b]+t: every sequence has its own
length. Pass start_pos as host ints (a list or a CPU tensor): the key length L is then known
without a device sync.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from .linear import linear as linear_any
from .quant import GEMV_QTYPES, check_qtype, row_bytes

ROPE_STYLES = ("norm", "neox")


def _rope_angles(pos: torch.Tensor, n_rot: int, theta: float, dtype: torch.dtype):
    """cos, sin [.., T, 1, n_rot/2] of pos * theta^(-2i/n_rot), computed in float64."""
    inv = theta ** (-torch.arange(0, n_rot, 2, device=pos.device, dtype=torch.float64) / n_rot)  # [n_rot/2]
    ang = pos.to(torch.float64)[..., None, None] * inv  # [.., T, 1, n_rot/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


class _StepCache:
    """Positions and rotary angles of the current step, shared by every layer's call.

    A decode step calls head_attention once per layer with the same start positions; building
    pos and cos/sin costs a dozen small kernels and a host-to-device copy each time, which on a
    GPU is host time of the same order as the attention itself. Keyed by everything they
    depend on; holds the last few entries only."""

    def __init__(self, size: int = 4) -> None:
        self.size, self.entries = size, {}

    def get(self, key, make):  # noqa: ANN001, ANN201
        hit = self.entries.get(key)
        if hit is None:
            if len(self.entries) >= self.size:
                self.entries.pop(next(iter(self.entries)))
            hit = self.entries[key] = make()
        return hit


_step_cache = _StepCache()


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0, style: str = "norm",
         n_rot: int | None = None, angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotary embedding of x [.., T, H, hd] at positions pos [.., T]; returns x's dtype.

    style 'norm' (GGML mode 0) rotates adjacent pairs (x[2i], x[2i+1]) -- llama GGUF files
    store Q/K permuted for it; 'neox' rotates halves (x[i], x[i + n_rot/2]) -- HF rotate_half,
    Falcon. Frequencies theta^(-2i/n_rot); dims >= n_rot (default hd) pass unchanged.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"rope: style is {style!r}, expected one of {ROPE_STYLES}")
    hd = x.shape[-1]
    n_rot = n_rot or hd
    if n_rot % 2 or n_rot > hd:
        raise ValueError(f"rope: n_rot is {n_rot}, expected an even number <= head_dim {hd}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = angles if angles is not None else _rope_angles(pos, n_rot, theta, cdt)  # [.., T, 1, n_rot/2]
    xr = x[..., :n_rot].to(cdt)  # [.., T, H, n_rot]
    if style == "norm":
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., n_rot:]), dim=-1) if n_rot < hd else out.to(x.dtype)


def _positions(start_pos, B: int, T: int, device) -> tuple[torch.Tensor, int]:
    """pos [B, T] on device and the key length L = max(start_pos) + T (host int)."""
    if isinstance(start_pos, torch.Tensor):
        sp = start_pos.reshape(-1)
        L = int(sp.max()) + T  # a device sync only when start_pos lives on the GPU
        sp = sp.to(device=device, dtype=torch.long, non_blocking=True)
    else:
        L = max(int(s) for s in start_pos) + T
        sp = torch.tensor(list(start_pos), dtype=torch.long).to(device, non_blocking=True)
    if sp.numel() != B:
        raise ValueError(f"head_attention: {sp.numel()} start positions, expected B={B}")
    return sp[:, None] + torch.arange(T, device=device), L  # [B, T]


def _check(x, wq, wk, wv, wo_t, k_cache, v_cache, qtype=None) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"head_attention: x.shape is {tuple(x.shape)}, expected [B, T, D]")
    D = x.shape[2]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"head_attention: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}, "
                         "expected equal [S_slots, Gs, S_max, hd]")
    Gs, hd = k_cache.shape[1], k_cache.shape[3]
    Hs = wq.shape[0] // hd
    width = D if qtype is None else row_bytes(check_qtype(qtype, "head_attention", GEMV_QTYPES), D)  # quantized
    o_rows = Hs * hd if qtype is None else row_bytes(qtype, Hs * hd)
    want = {"wq": (Hs * hd, width), "wk": (Gs * hd, width), "wv": (Gs * hd, width), "wo_t": (o_rows, D)}
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv), ("wo_t", wo_t)):
        if tuple(w.shape) != want[name]:
            raise ValueError(f"head_attention: {name}.shape is {tuple(w.shape)}, expected {want[name]}")
    if Hs == 0 or Hs % Gs:
        raise ValueError(f"head_attention: {Hs} query heads for {Gs} KV groups, expected a multiple")
    return Hs, Gs, hd


def head_attention(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo_t: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | Sequence[int],
                   start_pos: torch.Tensor | Sequence[int], rope_theta: float = 10000.0,
                   rope_style: str | None = "norm", n_rot: int | None = None,
                   bq: torch.Tensor | None = None, bk: torch.Tensor | None = None,
                   bv: torch.Tensor | None = None, *, wqkv: torch.Tensor | None = None,
                   bqkv: torch.Tensor | None = None, linear=None, qtype: str | None = None) -> torch.Tensor:
    """Partial attention output y [B, T, D] of the shard's heads (see the module docstring).

    x [B, T, D] (already normed); wq [Hs*hd, D]; wk, wv [Gs*hd, D]; wo_t [Hs*hd, D];
    k_cache, v_cache [S_slots, Gs, S_max, hd] (written in place); slots [B]; start_pos [B];
    rope_style 'norm' | 'neox' | None (learned positions, e.g. OPT); bq [Hs*hd], bk/bv [Gs*hd].
    Scale 1/sqrt(hd). torch SDPA on every device; GQA without copying K/V per query head (the
    query heads of a group are stacked along the query axis).
    wqkv [(Hs+2Gs)*hd, D] (and bqkv): the three projections stacked, when the caller holds them
    so (wq/wk/wv are then its row views): one matmul instead of three.
    linear: ``linear(x, w, b)`` computing F.linear for the projections (the output one as
    ``linear(o, wo_t.T, None)``), e.g. kernels.cpu_ffn.linear, which reads fp16 weights in place
    for fp32 x; None: F.linear and ``o @ wo_t``.
    qtype ('q4_0' | 'q8_0'): the weights are ggml blocks (quant.py): wq / wk / wv (wqkv) uint8
    [rows, D // 32 * block bytes], and wo_t the transposed view of the shard's o-projection
    columns' blocks [D, Hs*hd // 32 * block bytes] (so wo_t.T is row-major); the projections
    run as ``linear(x, w, b, qtype=qtype)`` (None: ``linear.linear``), cast to x's dtype.

    One sequence with host positions (the decode and prefill steps of a single request) takes
    a short path: one projection, one rotary call for q and k, slice writes into the cache,
    and no mask at T = 1 -- about a third of the kernel launches of the general path, which
    matters because at decode sizes the host's launch time, not the GPU, sets the pace. Prompt
    chunks of several sequences (T > 1, host positions) project together and attend one sequence
    at a time over views of its slot: no copy of every sequence's keys and values (B x L rows).
    """
    Hs, Gs, hd = _check(x, wq, wk, wv, wo_t, k_cache, v_cache, qtype)
    B, T, D = x.shape
    linear = _quantized(linear, qtype)
    if B == 1 and not isinstance(start_pos, torch.Tensor) and not isinstance(slots, torch.Tensor):
        return _one_sequence(x, wq, wk, wv, wo_t, k_cache, v_cache, int(slots[0]), int(start_pos[0]),
                             rope_theta, rope_style, n_rot, bq, bk, bv, wqkv, bqkv, linear)
    n_gqa = Hs // Gs
    angles = None
    if isinstance(start_pos, torch.Tensor):
        pos, L = _positions(start_pos, B, T, x.device)  # [B, T]
    else:  # host positions: build pos and the rotary angles once per step, not once per layer
        n_r = n_rot or hd
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = (tuple(int(v) for v in start_pos), B, T, str(x.device), rope_theta, n_r, cdt, rope_style is None)

        def make():  # noqa: ANN202
            p, length = _positions(start_pos, B, T, x.device)
            return p, length, (None if rope_style is None else _rope_angles(p, n_r, rope_theta, cdt))

        pos, L, angles = _step_cache.get(key, make)
    if L > k_cache.shape[2]:
        raise ValueError(f"head_attention: positions reach {L}, expected <= S_max {k_cache.shape[2]}")
    slots_t = torch.as_tensor(slots, dtype=torch.long).to(x.device, non_blocking=True).reshape(B)  # [B]
    lin = linear or F.linear
    q = lin(x, wq, bq).view(B, T, Hs, hd)
    k = lin(x, wk, bk).view(B, T, Gs, hd)
    v = lin(x, wv, bv).view(B, T, Gs, hd)
    if rope_style is not None:
        q = rope(q, pos, rope_theta, rope_style, n_rot, angles)
        k = rope(k, pos, rope_theta, rope_style, n_rot, angles)
    sl = slots_t[:, None].expand(B, T)  # [B, T]
    k_cache[sl, :, pos] = k.to(k_cache.dtype)  # advanced indices first: [B, T, Gs, hd]
    v_cache[sl, :, pos] = v.to(v_cache.dtype)
    if T > 1 and not isinstance(start_pos, torch.Tensor) and not (isinstance(slots, torch.Tensor) and slots.is_cuda):
        # prompt chunks of several sequences: each attends over views of its own slot (a gathered
        # copy of every sequence's keys and values would take B x L rows of the caches)
        o = torch.stack([_attend_slot(q[b], k_cache, v_cache, int(slots[b]), int(start_pos[b])) for b in range(B)])
        return _out_proj(o, wo_t, linear)  # [B, T, D]
    if B == 1 and not (isinstance(slots, torch.Tensor) and slots.is_cuda):  # a view of the slot, no copy
        s = int(slots[0])
        kc, vc = k_cache[s:s + 1, :, :L], v_cache[s:s + 1, :, :L]  # [1, Gs, L, hd]
    else:
        kc, vc = k_cache[slots_t, :, :L], v_cache[slots_t, :, :L]  # [B, Gs, L, hd]
    # queries of group g stacked: [B, Gs, n_gqa*T, hd]; head h = g*n_gqa + j
    qg = q.view(B, T, Gs, n_gqa, hd).permute(0, 2, 3, 1, 4).reshape(B, Gs, n_gqa * T, hd)
    allowed = torch.arange(L, device=x.device)[None, None, :] <= pos[:, :, None]  # [B, T, L]
    allowed = allowed[:, None, None].expand(B, 1, n_gqa, T, L).reshape(B, 1, n_gqa * T, L)
    o = F.scaled_dot_product_attention(qg, kc.to(q.dtype), vc.to(q.dtype), attn_mask=allowed,
                                       scale=1.0 / math.sqrt(hd))  # [B, Gs, n_gqa*T, hd]
    o = o.view(B, Gs, n_gqa, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, Hs * hd)
    return _out_proj(o, wo_t, linear)  # [B, T, D]


def _one_sequence(x, wq, wk, wv, wo_t, k_cache, v_cache, s: int, p: int, theta, style, n_rot,
                  bq, bk, bv, wqkv, bqkv, linear) -> torch.Tensor:  # noqa: ANN001
    """head_attention for B = 1 at host position p of cache slot s (see its docstring)."""
    _, T, D = x.shape
    Hs, hd, Gs = wq.shape[0] // k_cache.shape[-1], k_cache.shape[-1], k_cache.shape[1]
    L = p + T
    if L > k_cache.shape[2]:
        raise ValueError(f"head_attention: positions reach {L}, expected <= S_max {k_cache.shape[2]}")
    lin = linear or F.linear
    if wqkv is not None:
        qkv = lin(x[0], wqkv, bqkv).view(T, Hs + 2 * Gs, hd)  # [T, Hs+2Gs, hd]
    else:
        qkv = torch.cat([lin(x[0], w, b) for w, b in ((wq, bq), (wk, bk), (wv, bv))], -1).view(T, Hs + 2 * Gs, hd)
    qk, v = qkv[:, : Hs + Gs], qkv[:, Hs + Gs:]  # [T, Hs+Gs, hd], [T, Gs, hd]
    if style is not None:
        n_r = n_rot or hd
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = ((p,), 1, T, str(x.device), theta, n_r, cdt, False)

        def make():  # noqa: ANN202
            pos, length = _positions([p], 1, T, x.device)
            return pos, length, _rope_angles(pos, n_r, theta, cdt)

        pos, _, (cos, sin) = _step_cache.get(key, make)
        qk = rope(qk, pos[0], theta, style, n_rot, (cos[0], sin[0]))
    q, k = qk[:, :Hs], qk[:, Hs:]
    k_cache[s, :, p:L].copy_(k.transpose(0, 1))  # [Gs, T, hd]
    v_cache[s, :, p:L].copy_(v.transpose(0, 1))
    return _out_proj(_attend_slot(q, k_cache, v_cache, s, p), wo_t, linear)[None]  # [1, T, D]


def _attend_slot(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: int, p: int) -> torch.Tensor:
    """o [T, Hs*hd]: queries q [T, Hs, hd] at positions p.. of cache slot s (their K/V written)
    attend causally over views of that slot's first p + T positions."""
    T, Hs, hd = q.shape
    Gs, L = k_cache.shape[1], p + T
    kc, vc = k_cache[s:s + 1, :, :L].to(q.dtype), v_cache[s:s + 1, :, :L].to(q.dtype)  # [1, Gs, L, hd]
    mask = None
    if T > 1:  # causal within the new tokens, everything before them visible
        mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(p, L, device=q.device)[:, None]  # [T, L]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc, vc, attn_mask=mask,
                                       scale=1.0 / math.sqrt(hd), enable_gqa=Hs != Gs)  # [1, Hs, T, hd]
    return o[0].transpose(0, 1).reshape(T, Hs * hd)


def _quantized(linear, qtype: str | None):  # noqa: ANN001, ANN202
    """The projections' ``linear(x, w, b)`` for weights of qtype (None: ``linear`` as given)."""
    if qtype is None:
        return linear
    lin = linear or linear_any

    def quantized(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return lin(x, w, b, qtype=qtype).to(x.dtype)

    return quantized


def _out_proj(o: torch.Tensor, wo_t: torch.Tensor, linear) -> torch.Tensor:  # noqa: ANN001
    """o [.., Hs*hd] times the shard's output-projection rows wo_t [Hs*hd, D] -> [.., D]."""
    return o @ wo_t.to(o.dtype) if linear is None else linear(o, wo_t.T, None)


def rope_table(n_ctx: int, n_rot: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_ctx, n_rot/2] float32 of every position: a decode step gathers its rows by
    device positions (`head_attention_step`), no host work per step."""
    cos, sin = _rope_angles(torch.arange(n_ctx, device=device), n_rot, theta, torch.float32)  # [n_ctx, 1, n_rot/2]
    return cos[:, 0].contiguous(), sin[:, 0].contiguous()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     pos: torch.Tensor, scale: float, backend: str = "auto") -> torch.Tensor:
    """o [B, Hs, hd]: each sequence's one new query per head attends to keys 0 .. pos[b] of
    cache slot slots[b]. q [B, Hs, hd]; caches [S_slots, Gs, S_max, hd]; slots, pos [B] int
    tensors on q's device (read there: no host sync). backend 'auto' (Triton on CUDA when
    hd is a power of two >= 16) | 'triton' | 'torch' (masked, over the whole cache length)."""
    B, Hs, hd = q.shape
    if backend == "auto":
        backend = "triton" if q.is_cuda and hd >= 16 and hd & (hd - 1) == 0 else "torch"
    if backend == "triton":
        from .triton_attention import decode_attention_triton

        return decode_attention_triton(q, k_cache.to(q.dtype), v_cache.to(q.dtype), slots, pos, scale)
    Gs, S = k_cache.shape[1], k_cache.shape[2]
    kc = k_cache.index_select(0, slots.long()).to(q.dtype)  # [B, Gs, S, hd]
    vc = v_cache.index_select(0, slots.long()).to(q.dtype)
    qg = q.view(B, Gs, Hs // Gs, hd)  # [B, Gs, n_gqa, hd]
    s = torch.einsum("bgnd,bgsd->bgns", qg.float(), kc.float()) * scale  # [B, Gs, n_gqa, S]
    allowed = torch.arange(S, device=q.device)[None, :] <= pos.long()[:, None]  # [B, S]
    p = torch.softmax(s.masked_fill(~allowed[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("bgns,bgsd->bgnd", p, vc.float()).reshape(B, Hs, hd).to(q.dtype)


def head_attention_step(x: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, wo_t: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                        cos: torch.Tensor | None, sin: torch.Tensor | None, rope_style: str | None = "norm",
                        n_rot: int | None = None, qtype: str | None = None) -> torch.Tensor:
    """One decode token per sequence, with slots and positions as device tensors: the partial
    attention output y [B, D] of the shard's heads; writes K/V at pos[b] of slot slots[b].

    x [B, D] (normed); wqkv [(Hs+2Gs)*hd, D], bqkv; wo_t [Hs*hd, D]; slots, pos [B] int64 on
    x's device; cos, sin [B, n_rot/2] (rows of `rope_table` at pos) or None with rope_style
    None; qtype: quantized weights as `head_attention` takes them. Fixed shapes and no host
    reads: the decode step captures this in a CUDA graph.
    """
    B, D = x.shape
    Gs, hd = k_cache.shape[1], k_cache.shape[3]
    Hs = wqkv.shape[0] // hd - 2 * Gs
    lin = _quantized(None, qtype)
    qkv = (lin or F.linear)(x, wqkv, bqkv)  # [B, (Hs+2Gs)*hd]
    if x.is_cuda and hd >= 16 and hd & (hd - 1) == 0:  # rotary and the cache write in one Triton launch
        from .triton_attention import rope_cache_triton

        q = rope_cache_triton(qkv, cos, sin, rope_style, n_rot or hd, k_cache, v_cache, slots, pos, Hs, Gs)
    else:
        q = _rope_cache_torch(qkv.view(B, Hs + 2 * Gs, hd), cos, sin, rope_style, n_rot, k_cache, v_cache, slots,
                              pos, Hs)
    o = decode_attention(q, k_cache, v_cache, slots, pos, 1.0 / math.sqrt(hd))  # [B, Hs, hd]
    return _out_proj(o.reshape(B, Hs * hd), wo_t, lin)  # [B, D]


def _rope_cache_torch(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, rope_style: str | None,
                      n_rot: int | None, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      pos: torch.Tensor, Hs: int) -> torch.Tensor:
    """``triton_attention.rope_cache_triton`` in torch ops: qkv [B, Hs+2Gs, hd] -> q [B, Hs, hd]."""
    qk, v = qkv[:, : qkv.shape[1] - k_cache.shape[1]], qkv[:, qkv.shape[1] - k_cache.shape[1]:]  # q and k, v
    if rope_style is not None:
        qk = rope(qk, None, 0.0, rope_style, n_rot, (cos[:, None], sin[:, None]))  # theta is in the table
    k_cache[slots, :, pos] = qk[:, Hs:].to(k_cache.dtype)  # [B, Gs, hd]
    v_cache[slots, :, pos] = v.to(v_cache.dtype)
    return qk[:, :Hs]


def head_attention_ref(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo_t: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots, start_pos, rope_theta: float = 10000.0,
                       rope_style: str | None = "norm", n_rot: int | None = None, bq=None, bk=None,
                       bv=None) -> torch.Tensor:
    """float64 reference of `head_attention`, looping over sequences, heads and tokens.
    Writes the caches like the fast path; returns y [B, T, D] in float64."""
    Hs, Gs, hd = _check(x, wq, wk, wv, wo_t, k_cache, v_cache)
    B, T, D = x.shape
    n_gqa = Hs // Gs
    d = torch.float64
    y = torch.zeros(B, T, D, dtype=d, device=x.device)
    for b in range(B):
        s, p0 = int(slots[b]), int(start_pos[b])
        xb = x[b].to(d)  # [T, D]
        q = (xb @ wq.to(d).T + (0 if bq is None else bq.to(d))).view(T, Hs, hd)
        k = (xb @ wk.to(d).T + (0 if bk is None else bk.to(d))).view(T, Gs, hd)
        v = (xb @ wv.to(d).T + (0 if bv is None else bv.to(d))).view(T, Gs, hd)
        if rope_style is not None:
            pos = torch.arange(p0, p0 + T, device=x.device)
            q, k = rope(q, pos, rope_theta, rope_style, n_rot), rope(k, pos, rope_theta, rope_style, n_rot)
        k_cache[s, :, p0:p0 + T] = k.transpose(0, 1).to(k_cache.dtype)
        v_cache[s, :, p0:p0 + T] = v.transpose(0, 1).to(v_cache.dtype)
        o = torch.zeros(T, Hs, hd, dtype=d, device=x.device)
        for h in range(Hs):
            g = h // n_gqa
            for t in range(T):
                n = p0 + t + 1  # keys 0 .. p0+t
                keys = k_cache[s, g, :n].to(d)  # [n, hd]
                vals = v_cache[s, g, :n].to(d)
                p = torch.softmax(keys @ q[t, h] / math.sqrt(hd), dim=0)  # [n]
                o[t, h] = p @ vals
        y[b] = o.reshape(T, Hs * hd) @ wo_t.to(d)
    return y
