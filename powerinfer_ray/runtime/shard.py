"""What an executor holds for one layer, loaded from a WeightSource: only its own rows and heads.

``FFNShard``: rows of up / gate / down_t (and up's bias) of the executor's neurons.
``AttnShard``: q/k/v rows and the o-projection columns (transposed) of its KV-head groups, with
their KV cache [slots, Gs, S, hd]. Partial outputs of disjoint shards add up to the dense layer
(``layers.merge_partials``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model import gguf_keys as K
from ..model.config import ModelConfig
from ..model.source import WeightSource


@dataclass
class FFNShard:
    ids: np.ndarray  # [n] global neuron ids (sorted)
    up: torch.Tensor  # [n, D]
    gate: torch.Tensor | None  # [n, D]
    down_t: torch.Tensor  # [n, D]
    up_bias: torch.Tensor | None  # [n]

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.up, self.gate, self.down_t, self.up_bias)
                   if t is not None)


@dataclass
class AttnShard:
    groups: np.ndarray  # [Gs] KV-head groups
    wqkv: torch.Tensor  # [(Hs+2Gs)*hd, D]: q, k, v rows stacked (one matmul)
    bqkv: torch.Tensor | None
    wq: torch.Tensor  # [Hs*hd, D]  (row views of wqkv, likewise wk, wv and the biases)
    wk: torch.Tensor  # [Gs*hd, D]
    wv: torch.Tensor  # [Gs*hd, D]
    wo_t: torch.Tensor  # [Hs*hd, D]: transposed columns of attn_output for these heads
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    k_cache: torch.Tensor  # [slots, Gs, S, hd]
    v_cache: torch.Tensor  # [slots, Gs, S, hd]

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wqkv, self.wo_t))

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


def load_ffn_shard(src: WeightSource, l: int, ids: np.ndarray, dtype: torch.dtype,
                   device: torch.device) -> FFNShard:
    cfg = src.config

    def rows(tmpl: str, bias: bool = False) -> torch.Tensor:
        return src.layer(tmpl, l, rows=ids, dtype=dtype if not bias else torch.float32,
                         bias=bias, device=device).contiguous()

    return FFNShard(ids=np.asarray(ids, np.int64), up=rows(K.FFN_UP),
                    gate=rows(K.FFN_GATE) if cfg.gated else None, down_t=rows(K.FFN_DOWN_T),
                    up_bias=rows(K.FFN_UP, bias=True) if cfg.bias else None)


def load_attn_shard(src: WeightSource, l: int, groups: np.ndarray, dtype: torch.dtype,
                    device: torch.device, slots: int, n_ctx: int, *, cache_dtype: torch.dtype | None = None,
                    out_rows: bool = False) -> AttnShard:
    """Layer l's attention for the KV-head groups `groups`: weights in dtype, KV cache in
    cache_dtype (default dtype). out_rows: wo_t is the transposed view of a row-major [D, Hs*hd]
    (wo_t.T has unit column stride: what kernels.cpu_ffn.linear reads in place on the CPU);
    else wo_t itself is row-major."""
    cfg = src.config
    q_rows, kv_rows = head_rows(cfg, np.asarray(groups, np.int64))

    def rows(tmpl: str, r: np.ndarray, bias: bool = False) -> torch.Tensor | None:
        if bias and not cfg.bias:
            return None
        t = src.layer(tmpl, l, rows=r, dtype=dtype, bias=bias, device=device)  # F.linear wants one dtype
        return t.contiguous()

    if len(groups) == 0:  # nothing of this layer's attention here: skip reading attn_output
        wo_t = torch.empty(0, cfg.n_embd, dtype=dtype, device=device)
    else:
        wo = src.layer(K.ATTN_OUT, l, dtype=dtype, device=device)  # [D, H*hd]
        wo_t = wo[:, torch.from_numpy(q_rows).to(device)].T  # our heads' columns (a copy)
        wo_t = wo_t if out_rows else wo_t.contiguous()
    cache_shape = (slots, len(groups), n_ctx, cfg.head_dim)
    nq, nkv = len(q_rows), len(kv_rows)
    wqkv = torch.cat([rows(K.ATTN_Q, q_rows), rows(K.ATTN_K, kv_rows), rows(K.ATTN_V, kv_rows)])
    bqkv = torch.cat([rows(K.ATTN_Q, q_rows, True), rows(K.ATTN_K, kv_rows, True),
                      rows(K.ATTN_V, kv_rows, True)]) if cfg.bias else None
    part = lambda t, a, b: None if t is None else t[a:b]  # noqa: E731
    return AttnShard(groups=np.asarray(groups, np.int64), wqkv=wqkv, bqkv=bqkv,
                     wq=wqkv[:nq], wk=wqkv[nq:nq + nkv], wv=wqkv[nq + nkv:], wo_t=wo_t,
                     bq=part(bqkv, 0, nq), bk=part(bqkv, nq, nq + nkv), bv=part(bqkv, nq + nkv, nq + 2 * nkv),
                     k_cache=torch.zeros(cache_shape, dtype=cache_dtype or dtype, device=device),
                     v_cache=torch.zeros(cache_shape, dtype=cache_dtype or dtype, device=device))
