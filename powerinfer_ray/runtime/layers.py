"""Per-layer partial computations over an executor's shard, and the one merge function.

``ffn_partial`` and ``attn_partial`` compute an executor's share of a layer; partial outputs
over disjoint neuron / head sets add up to the dense layer, which ``merge_partials`` does (with
the biases that belong to the whole layer added exactly once).

Predictor policies (the coordinator chooses one per engine):
  predictor  the shard's active set per token comes from the predictor (logit >= threshold)
  oracle     the true activations: the shard computes its own gate/up once to find them
             (test-only: checks the sparse path against dense without predictor error)
  dense      every neuron of the shard, for models without predictors
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.quant import dequantize, round_q8_0
from ..kernels.sparse_ffn import sparse_ffn
from ..model.config import ModelConfig
from ..model.reference import ffn_activation
from .shard import AttnShard, FFNShard

POLICIES = ("predictor", "oracle", "dense")


@dataclass(frozen=True)
class Policy:
    """How the primary finds a layer's active neurons: a name of POLICIES and the predictor's
    threshold (neuron j is active iff its logit >= threshold)."""

    name: str
    threshold: float = 0.0

    @classmethod
    def for_model(cls, name: str, threshold: float | None, cfg: ModelConfig) -> "Policy":
        """The policy for a model; threshold None: the model's own (``powerinfer.sparse_threshold``)."""
        if name not in POLICIES:
            raise ValueError(f"predictor policy {name!r}: expected one of {POLICIES}")
        if name == "predictor" and not cfg.has_predictors:
            raise ValueError(f"policy 'predictor' needs a model with predictors; {cfg.name or 'this model'} "
                             "has none: train them (powerinfer-ray train-predictors) or use policy 'dense'")
        thr = cfg.sparse_threshold if threshold is None else threshold
        return cls(name, 0.0 if thr is None else float(thr))


def active_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bool mask [T, n] -> (idx [K] of rows active for any token, per-token mask [T, K] or None
    when T == 1, where every listed row is active)."""
    idx = mask.any(0).nonzero().reshape(-1)  # [K]
    return idx, (None if mask.shape[0] == 1 else mask.index_select(1, idx))


def oracle_mask(x: torch.Tensor, shard: FFNShard, act: str) -> torch.Tensor:
    """The true activity [T, n] of the shard's neurons for inputs x [T, D] (h != 0), as the
    kernels compute it: on quantized rows of a CPU shard, of x rounded to Q8_0 (what the CPU
    kernel multiplies)."""
    q = shard.qtype
    xf = x.float() if q is None or x.is_cuda else round_q8_0(x).float()
    sel = None if shard.rows is None else shard.rows.long()
    pick = lambda t: t if sel is None else t[sel]  # noqa: E731  (the shard's neurons' rows, in order)
    rows = lambda w: pick(w).float() if q is None else dequantize(pick(w), q)  # noqa: E731
    up = xf @ rows(shard.up).T  # [T, n]
    if shard.up_bias is not None:
        up = up + pick(shard.up_bias)
    gate = xf @ rows(shard.gate).T if shard.gate is not None else None  # [T, n]
    return ffn_activation(act, up, gate) != 0


def ffn_partial(x: torch.Tensor, shard: FFNShard, act: str, policy: str,
                mask: torch.Tensor | None = None, out: torch.Tensor | None = None,
                threads: int | None = None) -> tuple[torch.Tensor, int, int]:
    """The shard's FFN output y [T, D] for x [T, D] (without the down bias), the number of
    (token, neuron) pairs computed, and the number of neuron rows read (each once per call).
    ``mask`` [T, n] bool is the predicted activity (policy 'predictor')."""
    T = x.shape[0]
    if shard.n == 0:
        y = out.zero_() if out is not None else torch.zeros_like(x)
        return y, 0, 0
    if policy == "oracle":
        mask = oracle_mask(x, shard, act)
    if policy == "dense" or mask is None:
        idx = torch.arange(shard.n, device=x.device)
        tok_mask, computed = None, T * shard.n
    else:
        idx, tok_mask = active_rows(mask)
        computed = int(mask.sum()) if tok_mask is not None else idx.numel()
    y = sparse_ffn(x, shard.up, shard.gate, shard.down_t, shard.row_index(idx), tok_mask, act, shard.up_bias,
                   out, threads=threads, qtype=shard.qtype)
    return y, computed, idx.numel()


def attn_partial(x: torch.Tensor, shard: AttnShard, cfg: ModelConfig, slots: list[int],
                 start_pos: list[int], linear=None) -> torch.Tensor:  # noqa: ANN001
    """The shard's heads' share of the attention output y [B, T, D] for normed x [B, T, D];
    writes this step's K/V into the shard's cache at start_pos of each sequence's slot.
    linear: the projections' F.linear (see kernels.head_attention; on quantized weights it takes
    ``qtype=``)."""
    from ..kernels.attention import head_attention

    return head_attention(x, shard.wq, shard.wk, shard.wv, shard.wo_t, shard.k_cache, shard.v_cache,
                          slots, start_pos, cfg.rope_theta, cfg.rope_style, cfg.rot_dims,
                          bq=shard.bq, bk=shard.bk, bv=shard.bv, wqkv=shard.wqkv, bqkv=shard.bqkv,
                          linear=linear, qtype=shard.qtype)


def merge_partials(parts: list[torch.Tensor | None], bias: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of the partial outputs [T, D] of disjoint shards (None = a shard with nothing to add),
    plus the layer's output bias once. This is where executors' results meet."""
    present = [p for p in parts if p is not None]
    assert present, "merge_partials needs at least one partial output"
    y = present[0].float().clone()
    for p in present[1:]:
        y += p.to(device=y.device, dtype=torch.float32)
    if bias is not None:
        y += bias.float()
    return y
