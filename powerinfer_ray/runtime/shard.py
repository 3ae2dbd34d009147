"""What an executor holds for one layer, loaded from a WeightSource: only its own rows and heads.

``FFNShard``: rows of up / gate / down_t (and up's bias) of the executor's neurons: a copy of
them (``load_ffn_shard``), or, where the model file stores them as the compute reads them, the
file's whole matrices in its memory map with the row of each neuron (``in_place_ffn_shard``).
``AttnShard``: q/k/v rows and the o-projection columns (transposed) of its KV-head groups, with
their KV cache [slots, Gs, S, hd]. Partial outputs of disjoint shards add up to the dense layer
(``layers.merge_partials``).

Matrices a source stores as ggml Q8_0 / Q4_0 blocks (``WeightSource.qtype``) are held as their
blocks, uint8 [rows, cols / 32 * block bytes], with the shard's ``qtype`` beside them (the
kernels take them so); every other matrix in the float ``dtype`` asked for. A head's q/k/v rows
and a KV-head group's o-projection columns are whole blocks when the group's columns
(n_gqa * head_dim) are a multiple of 32; a plan that splits a layer's heads otherwise is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..model import gguf_keys as K
from ..model.config import ModelConfig
from ..model.qtypes import BLOCK_BYTES, QK, row_bytes
from ..model.source import WeightSource, layer_rows, mapped_tensor


@dataclass
class FFNShard:
    """Neuron j of the shard (global id ids[j]) is row ``rows[j]`` of up, gate, down_t and up_bias
    (row j when ``rows`` is None: a copy holding the shard's rows only, R = n)."""

    ids: np.ndarray  # [n] global neuron ids, in shard order (the CPU mask's bit j is neuron ids[j])
    up: torch.Tensor  # [R, D]
    gate: torch.Tensor | None  # [R, D]
    down_t: torch.Tensor  # [R, D]
    up_bias: torch.Tensor | None  # [R]
    qtype: str | None = None  # 'q8_0' | 'q4_0': up, gate, down_t are blocks uint8 [R, D / 32 * block bytes]
    rows: torch.Tensor | None = None  # [n] int32 (in place: the global ids, R = n_ff)

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def in_place(self) -> bool:
        return self.rows is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the shard's neurons (n rows of each matrix and of the bias)."""
        per_row = sum(t.element_size() * (t.shape[1] if t.dim() == 2 else 1)
                      for t in (self.up, self.gate, self.down_t, self.up_bias) if t is not None)
        return self.n * per_row

    def row_index(self, idx: torch.Tensor) -> torch.Tensor:
        """The rows of up / gate / down_t of the shard's neurons idx [K] (int64, idx's device)."""
        return idx if self.rows is None else self.rows.to(idx.device).long()[idx]


@dataclass
class AttnShard:
    groups: np.ndarray  # [Gs] KV-head groups
    wqkv: torch.Tensor | None  # [(Hs+2Gs)*hd, D]: q, k, v rows stacked (one matmul); None in place
    bqkv: torch.Tensor | None
    wq: torch.Tensor  # [Hs*hd, D]  (row views of wqkv, likewise wk, wv and the biases)
    wk: torch.Tensor  # [Gs*hd, D]
    wv: torch.Tensor  # [Gs*hd, D]
    # [Hs*hd, D]: transposed columns of attn_output for these heads (quantized: the transposed
    # view of those columns' blocks [D, Hs*hd / 32 * block bytes], rows with unit stride)
    wo_t: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    k_cache: torch.Tensor  # [slots, Gs, S, hd]
    v_cache: torch.Tensor  # [slots, Gs, S, hd]
    qtype: str | None = None  # 'q8_0' | 'q4_0': wqkv (and its views) and wo_t.T are blocks

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wq, self.wk, self.wv, self.wo_t))

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()


def head_rows(cfg: ModelConfig, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row ids of q (query heads of the groups) and of k/v (the groups) in the full matrices."""
    hd, g = cfg.head_dim, cfg.n_gqa
    heads = (groups[:, None] * g + np.arange(g)[None, :]).reshape(-1)  # [Hs]
    q_rows = (heads[:, None] * hd + np.arange(hd)[None, :]).reshape(-1)  # [Hs*hd]
    kv_rows = (groups[:, None] * hd + np.arange(hd)[None, :]).reshape(-1)  # [Gs*hd]
    return q_rows.astype(np.int64), kv_rows.astype(np.int64)


def matrices_qtype(src: WeightSource, l: int, templates: list[str], what: str) -> str | None:
    """The one storage of layer l's matrices ``templates`` that the kernels take together: a qtype
    when the source hands them out as blocks, None in float; ValueError when they differ."""
    kinds = {t: src.qtype(t, l) for t in templates}
    if len(set(kinds.values())) > 1:
        got = ", ".join(f"{K.tensor(t, l)}: {q or 'float'}" for t, q in kinds.items())
        raise ValueError(f"layer {l}'s {what} matrices are stored in different types ({got}); the kernels "
                         "take them in one: re-quantize the file with `powerinfer-ray quantize IN.gguf OUT.gguf "
                         "q4_0` (or q8_0)")
    return next(iter(kinds.values()))


def ffn_templates(cfg: ModelConfig) -> list[str]:
    return [K.FFN_UP] + ([K.FFN_GATE] if cfg.gated else []) + [K.FFN_DOWN_T]


def ffn_qtype(src: WeightSource) -> str | None:
    """The storage of every layer's FFN rows (the CPU executor lays them out in one file): a
    qtype, or None in float; ValueError when layers differ."""
    cfg = src.config
    kinds = {matrices_qtype(src, l, ffn_templates(cfg), "FFN") for l in range(cfg.n_layer)}
    if len(kinds) > 1:
        raise ValueError(f"the FFN matrices are stored as {sorted(map(str, kinds))} in different layers; "
                         "re-quantize the file with `powerinfer-ray quantize IN.gguf OUT.gguf q4_0` (or q8_0)")
    return kinds.pop()


def _ffn_rows(src: WeightSource, l: int, tmpl: str, ids: np.ndarray, dtype: torch.dtype, device: torch.device,
              qtype: str | None, bias: bool = False) -> torch.Tensor:
    """Rows ``ids`` of layer l's FFN matrix ``tmpl`` (or its bias, f32): float rows in dtype, or blocks."""
    if qtype is not None and not bias:
        return src.layer_blocks(tmpl, l, rows=ids, device=device).blocks.contiguous()
    return layer_rows(src, tmpl, l, rows=ids, dtype=dtype if not bias else torch.float32,
                      bias=bias, device=device).contiguous()


def load_ffn_shard(src: WeightSource, l: int, ids: np.ndarray, dtype: torch.dtype,
                   device: torch.device) -> FFNShard:
    """Layer l's neurons ``ids``: float rows in dtype, or their blocks (see the module docstring)."""
    cfg = src.config
    qtype = matrices_qtype(src, l, ffn_templates(cfg), "FFN")
    rows = lambda tmpl, bias=False: _ffn_rows(src, l, tmpl, ids, dtype, device, qtype, bias)  # noqa: E731
    return FFNShard(ids=np.asarray(ids, np.int64), up=rows(K.FFN_UP),
                    gate=rows(K.FFN_GATE) if cfg.gated else None, down_t=rows(K.FFN_DOWN_T),
                    up_bias=rows(K.FFN_UP, bias=True) if cfg.bias else None, qtype=qtype)


def replace_neurons(src: WeightSource, l: int, shard: FFNShard, at: np.ndarray, ids: np.ndarray) -> None:
    """Neurons ``ids`` of layer l take the shard's rows ``at`` [m], in place (the tensors keep
    their addresses: captured graphs and prepared kernel calls stay valid). In place in a file's
    map that is a change of row ids; a copy gets the new rows from ``src``, one matrix at a time
    (a transient of m rows of one matrix on the shard's device)."""
    at, ids = np.asarray(at, np.int64), np.asarray(ids, np.int64)
    shard.ids = shard.ids.copy()  # it may be the plan's own array (plans are values)
    shard.ids[at] = ids
    if shard.in_place:
        shard.rows[torch.from_numpy(at)] = torch.from_numpy(ids.astype(np.int32))
        return
    dev = shard.up.device
    pos = torch.from_numpy(at).to(dev)
    mats = [(K.FFN_UP, False, shard.up), (K.FFN_GATE, False, shard.gate), (K.FFN_DOWN_T, False, shard.down_t),
            (K.FFN_UP, True, shard.up_bias)]
    for tmpl, bias, t in mats:
        if t is not None:
            t.index_copy_(0, pos, _ffn_rows(src, l, tmpl, ids, t.dtype, dev, shard.qtype, bias))


def in_place_ffn_shard(src: WeightSource, l: int, ids: np.ndarray, dtype: torch.dtype | None) -> FFNShard | None:
    """Layer l's neurons ``ids`` as views of the model file's ffn_up / ffn_gate / ffn_down_t
    [n_ff, D] (and up's bias) in its memory map, without a copy: float rows, or the blocks of a
    quantized file (the shard's qtype); None when the file cannot serve them so: no file, another
    layout (ffn_down untransposed, fused), or float rows of a dtype other than ``dtype`` (None:
    any float dtype the file has)."""
    cfg = src.config
    mats = ffn_templates(cfg)
    qtype = matrices_qtype(src, l, mats, "FFN")
    views = [mapped_tensor(src, K.tensor(t, l)) for t in mats]
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if qtype is None:
        want, ok = (cfg.n_ff, cfg.n_embd), lambda v: v.dtype in floats and (dtype is None or v.dtype == dtype)
    else:
        want, ok = (cfg.n_ff, row_bytes(qtype, cfg.n_embd)), lambda v: v.dtype == torch.uint8
    if any(v is None or tuple(v.shape) != want or v.stride(1) != 1 or not ok(v) or v.dtype != views[0].dtype
           for v in views):
        return None
    bias = mapped_tensor(src, K.tensor(K.FFN_UP, l, True)) if cfg.bias else None
    if cfg.bias and (bias is None or tuple(bias.shape) != (cfg.n_ff,)):
        return None
    ids = np.asarray(ids, np.int64)
    return FFNShard(ids, views[0], views[1] if cfg.gated else None, views[-1], bias, qtype,
                    rows=torch.from_numpy(ids.astype(np.int32)))


def attn_views(src: WeightSource, l: int, groups: np.ndarray, dtype: torch.dtype) -> dict[str, Any] | None:
    """Layer l's q / k / v rows and output columns of the KV-head groups ``groups`` as views of the
    model file's tensors in its memory map (wo_t in the ``out_rows`` form of ``load_attn_shard``;
    a quantized file's blocks, the columns whole blocks), by AttnShard field; None when the groups
    are not one contiguous range or the file holds the tensors otherwise (fused qkv, another float
    dtype than ``dtype``, columns that split a block)."""
    cfg = src.config
    groups = np.asarray(groups, np.int64)
    if not len(groups) or not np.array_equal(groups, np.arange(groups[0], groups[0] + len(groups))):
        return None
    q_rows, kv_rows = head_rows(cfg, groups)
    (q0, q1), (k0, k1) = (int(q_rows[0]), int(q_rows[-1]) + 1), (int(kv_rows[0]), int(kv_rows[-1]) + 1)
    qtype = matrices_qtype(src, l, [K.ATTN_Q, K.ATTN_K, K.ATTN_V, K.ATTN_OUT], "attention")
    t = {tmpl: mapped_tensor(src, K.tensor(tmpl, l)) for tmpl in (K.ATTN_Q, K.ATTN_K, K.ATTN_V, K.ATTN_OUT)}
    want = dtype if qtype is None else torch.uint8
    if any(v is None or v.dtype != want or v.dim() != 2 or v.stride(1) != 1 for v in t.values()):
        return None
    c0, c1 = q0, q1  # attn_output's columns of our heads
    if qtype is not None:
        if q0 % QK or q1 % QK:
            return None
        c0, c1 = q0 // QK * BLOCK_BYTES[qtype], q1 // QK * BLOCK_BYTES[qtype]  # as bytes of its block rows
    qkv_bias = cfg.has_qkv_bias  # (qwen2: q/k/v biases without the others)
    b = {tmpl: mapped_tensor(src, K.tensor(tmpl, l, True)) if qkv_bias else None for tmpl in (K.ATTN_Q, K.ATTN_K, K.ATTN_V)}
    if qkv_bias and any(v is None or v.dtype != torch.float32 for v in b.values()):
        return None
    part = lambda v, a, z: None if v is None else v[a:z]  # noqa: E731
    return dict(wq=t[K.ATTN_Q][q0:q1], wk=t[K.ATTN_K][k0:k1], wv=t[K.ATTN_V][k0:k1], wo_t=t[K.ATTN_OUT][:, c0:c1].T,
                bq=part(b[K.ATTN_Q], q0, q1), bk=part(b[K.ATTN_K], k0, k1), bv=part(b[K.ATTN_V], k0, k1),
                qtype=qtype)


def in_place_attn_shard(src: WeightSource, l: int, groups: np.ndarray, dtype: torch.dtype, slots: int, n_ctx: int,
                        cache_dtype: torch.dtype) -> AttnShard | None:
    """Layer l's attention for ``groups`` over the file's own rows (``attn_views``), with a KV
    cache of its own [slots, Gs, n_ctx, hd]; None where ``attn_views`` is."""
    views = attn_views(src, l, groups, dtype)
    if views is None:
        return None
    cache_shape = (slots, len(groups), n_ctx, src.config.head_dim)
    return AttnShard(groups=np.asarray(groups, np.int64), wqkv=None, bqkv=None, **views,
                     k_cache=torch.zeros(cache_shape, dtype=cache_dtype), v_cache=torch.zeros(cache_shape, dtype=cache_dtype))


def load_attn_shard(src: WeightSource, l: int, groups: np.ndarray, dtype: torch.dtype,
                    device: torch.device, slots: int, n_ctx: int, *, cache_dtype: torch.dtype | None = None,
                    out_rows: bool = False) -> AttnShard:
    """Layer l's attention for the KV-head groups `groups`: weights in dtype (or their blocks, see
    the module docstring), KV cache in cache_dtype (default dtype). out_rows: wo_t is the
    transposed view of a row-major [D, Hs*hd] (wo_t.T has unit column stride: what
    kernels.cpu_ffn.linear reads in place on the CPU); else wo_t itself is row-major. Quantized,
    wo_t is always the transposed view of the columns' blocks."""
    cfg = src.config
    groups = np.asarray(groups, np.int64)
    q_rows, kv_rows = head_rows(cfg, groups)
    qtype = matrices_qtype(src, l, [K.ATTN_Q, K.ATTN_K, K.ATTN_V, K.ATTN_OUT], "attention")
    if qtype is not None and 0 < len(groups) < cfg.n_head_kv and (cfg.n_gqa * cfg.head_dim) % QK:
        raise ValueError(f"layer {l}: the plan splits the attention heads between the executors, but a KV-head "
                         f"group's {cfg.n_gqa * cfg.head_dim} o-projection columns are not whole {qtype} blocks "
                         f"of {QK}: place each layer's heads on one executor, or convert the model to f16")

    def rows(tmpl: str, r: np.ndarray, bias: bool = False) -> torch.Tensor | None:
        if bias and not cfg.has_qkv_bias:
            return None
        if qtype is not None:  # blocks; the biases in f32 (the quantized GEMV adds them in f32)
            return src.layer(tmpl, l, rows=r, dtype=torch.float32, bias=True, device=device) if bias \
                else src.layer_blocks(tmpl, l, rows=r, device=device).blocks.contiguous()
        t = layer_rows(src, tmpl, l, rows=r, dtype=dtype, bias=bias, device=device)  # F.linear wants one dtype
        return t.contiguous()

    if len(groups) == 0:  # nothing of this layer's attention here: skip reading attn_output
        wo_t = torch.empty(0, cfg.n_embd, dtype=dtype if qtype is None else torch.uint8, device=device)
    elif qtype is not None:
        wo = src.layer_blocks(K.ATTN_OUT, l, device=device).blocks  # [D, H*hd / 32 * block bytes]
        wo_t = wo[:, torch.from_numpy(_block_bytes(q_rows, qtype)).to(device)].T  # a view of our columns' copy
    else:
        wo = layer_rows(src, K.ATTN_OUT, l, dtype=dtype, device=device)  # [D, H*hd]
        wo_t = wo[:, torch.from_numpy(q_rows).to(device)].T  # our heads' columns (a copy)
        wo_t = wo_t if out_rows else wo_t.contiguous()
    cache_shape = (slots, len(groups), n_ctx, cfg.head_dim)
    nq, nkv = len(q_rows), len(kv_rows)
    wqkv = torch.cat([rows(K.ATTN_Q, q_rows), rows(K.ATTN_K, kv_rows), rows(K.ATTN_V, kv_rows)])
    bqkv = torch.cat([rows(K.ATTN_Q, q_rows, True), rows(K.ATTN_K, kv_rows, True),
                      rows(K.ATTN_V, kv_rows, True)]) if cfg.has_qkv_bias else None
    part = lambda t, a, b: None if t is None else t[a:b]  # noqa: E731
    return AttnShard(groups=groups, wqkv=wqkv, bqkv=bqkv,
                     wq=wqkv[:nq], wk=wqkv[nq:nq + nkv], wv=wqkv[nq + nkv:], wo_t=wo_t,
                     bq=part(bqkv, 0, nq), bk=part(bqkv, nq, nq + nkv), bv=part(bqkv, nq + nkv, nq + 2 * nkv),
                     k_cache=torch.zeros(cache_shape, dtype=cache_dtype or dtype, device=device),
                     v_cache=torch.zeros(cache_shape, dtype=cache_dtype or dtype, device=device), qtype=qtype)


def _block_bytes(cols: np.ndarray, qtype: str) -> np.ndarray:
    """The byte columns of a row of qtype blocks that hold weight columns ``cols`` (whole blocks:
    runs of QK starting at multiples of QK)."""
    bb = BLOCK_BYTES[qtype]
    blocks = cols[::QK] // QK  # [n / QK]
    assert np.array_equal(cols, (blocks[:, None] * QK + np.arange(QK)).reshape(-1)), "columns are not whole blocks"
    return (blocks[:, None] * bb + np.arange(bb)).reshape(-1).astype(np.int64)
