"""The sparse FFN in torch ops: its float64 reference and the gather path that runs on any device.

Dimension legend: T tokens, D n_embd, N rows of the shard, K active neurons (idx). See
sparse_ffn.py for the operation; both forms here take its arguments (already checked). With a
qtype the weights are quantized rows (quant.py), dequantized exactly after the gather.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import dequantize

ACTS = ("relu", "reglu", "drelu", "swiglu")
ACT_ON = ("gate", "h")  # what an activation threshold compares: |SiLU(gate)| or |h|


def _activation(act: str, u: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """h = act(g, u) elementwise, in u's dtype."""
    if act == "relu":
        return torch.relu(u)
    if act == "reglu":
        return torch.relu(g) * u
    if act == "drelu":
        return torch.relu(g) * torch.relu(u)
    return F.silu(g) * u  # swiglu


def apply_act_threshold(h: torch.Tensor, g: torch.Tensor, t: float, on: str) -> torch.Tensor:
    """h [T, K] with h_j zeroed where the criterion (|SiLU(g_j)| for on='gate', |h_j| for 'h') is
    not above t (the SwiGLU activation threshold)."""
    crit = F.silu(g).abs() if on == "gate" else h.abs()
    return torch.where(crit > t, h, torch.zeros((), dtype=h.dtype, device=h.device))


def bits_to_mask(bits: torch.Tensor, T: int) -> torch.Tensor:
    """int32 token bitmask [K] -> bool [T, K]."""
    shifts = torch.arange(T, device=bits.device, dtype=torch.int32)[:, None]  # [T, 1]
    return ((bits.to(torch.int32)[None, :] >> shifts) & 1).bool()  # [T, K]


def rows_of(w: torch.Tensor, rows: torch.Tensor, qtype: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` of w in dtype: [K, D] (quantized rows dequantized)."""
    r = w.index_select(0, rows)
    return r.to(dtype) if qtype is None else dequantize(r, qtype, dtype)


def _gate(x: torch.Tensor, gate: torch.Tensor | None, gate_pre: torch.Tensor | None, rows: torch.Tensor,
          qtype: str | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Gate pre-activations [T, K] of the rows: given (gate_pre [T, N]) or computed from the rows."""
    if gate_pre is not None:
        return gate_pre.index_select(1, rows).to(dtype)
    return x @ rows_of(gate, rows, qtype, dtype).T if gate is not None else None


def sparse_ffn_ref(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
                   idx: torch.Tensor, mask: torch.Tensor | None = None, act: str = "reglu",
                   up_bias: torch.Tensor | None = None, n_active: torch.Tensor | None = None,
                   qtype: str | None = None, act_threshold: float | None = None, act_on: str = "gate",
                   gate_pre: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 reference of `sparse_ffn`: y [T, D] in float64, loop-free and obvious. For the
    CPU kernels on quantized rows pass x = quant.round_q8_0(x), the activation they multiply."""
    T = x.shape[0]
    K = idx.shape[0] if n_active is None else int(n_active.reshape(-1)[0])
    rows = idx[:K].long()  # [K]
    if mask is not None and mask.dtype != torch.bool:
        mask = bits_to_mask(mask, T)
    xd = x.double()  # [T, D]
    u = xd @ rows_of(up, rows, qtype, torch.float64).T  # [T, K]
    if up_bias is not None:
        u = u + up_bias[rows].double()[None, :]
    g = _gate(xd, gate, gate_pre, rows, qtype, torch.float64)  # [T, K]
    h = _activation(act, u, g)  # [T, K]
    if act_threshold is not None:
        h = apply_act_threshold(h, g, act_threshold, act_on)
    if mask is not None:
        h = h * mask[:, :K].double()
    return h @ rows_of(down_t, rows, qtype, torch.float64)  # [T, D]


def sparse_ffn_torch(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
                     idx: torch.Tensor, mask: torch.Tensor | None = None, act: str = "reglu",
                     up_bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     n_active: torch.Tensor | None = None, qtype: str | None = None,
                     act_threshold: float | None = None, act_on: str = "gate",
                     gate_pre: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: gather the active rows, multiply in fp32. Works on any device."""
    T, D = x.shape
    if n_active is not None:  # host read of the count: this path syncs
        K = min(int(n_active.reshape(-1)[0]), idx.shape[0])
        idx = idx[:K]
        if mask is not None:
            mask = mask[:, :K] if mask.dtype == torch.bool else mask[:K]
    rows = idx.long()  # [K]
    xf = x.float()  # [T, D]
    u = xf @ rows_of(up, rows, qtype, torch.float32).T  # [T, K]
    if up_bias is not None:
        u = u + up_bias.index_select(0, rows).float()[None, :]
    g = _gate(xf, gate, gate_pre, rows, qtype, torch.float32)  # [T, K]
    h = _activation(act, u, g)  # [T, K]
    if act_threshold is not None:
        h = apply_act_threshold(h, g, act_threshold, act_on)
    if mask is not None:
        h = h * (mask if mask.dtype == torch.bool else bits_to_mask(mask, T)).float()
    y = h @ rows_of(down_t, rows, qtype, torch.float32)  # [T, D]
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)


def sparse_ffn_gemm(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
                    idx: torch.Tensor | None, mask: torch.Tensor | None = None, act: str = "reglu",
                    up_bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    qtype: str | None = None, act_threshold: float | None = None, act_on: str = "gate",
                    gate_pre: torch.Tensor | None = None, count: torch.Tensor | None = None,
                    chunk_bytes: int = 16 << 20) -> torch.Tensor:
    """The path for many tokens at once (a prompt chunk on a GPU): every row of the shard through
    matrix multiplies in the compute dtype (x's when the rows are stored in it or quantized, else
    fp32), h zeroed outside the active rows idx (distinct; None: every row, the mask [T, N] over
    them) and their mask, so each row is read once per call whatever T is. Rows go in chunks whose
    temporaries (u, g, h of T tokens; rows in another type converted, quantized rows dequantized)
    take about ``chunk_bytes``, as little as the VRAM budget leaves to a step. count [N] int64: adds
    the tokens in which each row's h is nonzero (after the threshold and the mask)."""
    T, D = x.shape
    N = up.shape[0]
    half = x.dtype in (torch.float16, torch.bfloat16) and (qtype is not None or up.dtype == x.dtype)
    dt = x.dtype if half else torch.float32
    if mask is not None and mask.dtype != torch.bool:
        mask = bits_to_mask(mask, T)
    keep = mask  # [T, N] or None (every row, every token)
    if idx is not None:
        keep = torch.zeros(T, N, dtype=torch.bool, device=x.device)
        keep[:, idx.long()] = True if mask is None else mask
    xc = x.to(dt)
    y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    converted = 0 if qtype is None and up.dtype == dt else 3 * D * torch.finfo(dt).bits // 8
    step = max(64, chunk_bytes // (converted + 16 * T))  # bytes per row: its converted weights, 4 fp32 [T]
    for a in range(0, N, step):
        b = min(N, a + step)
        rows = lambda w: w[a:b].to(dt) if qtype is None else dequantize(w[a:b], qtype, dt)  # noqa: E731
        u = (xc @ rows(up).T).float()  # [T, b-a]
        if up_bias is not None:
            u = u + up_bias[a:b].float()
        g = gate_pre[:, a:b] if gate_pre is not None else (xc @ rows(gate).T).float() if gate is not None else None
        h = _activation(act, u, g)
        if act_threshold is not None:
            h = apply_act_threshold(h, g, act_threshold, act_on)
        if keep is not None:
            h = h * keep[:, a:b]
        if count is not None:
            count[a:b] += (h != 0).sum(0)
        y += (h.to(dt) @ rows(down_t)).float()
    return y.to(x.dtype) if out is None else out.copy_(y)
