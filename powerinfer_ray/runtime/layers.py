"""Per-layer partial computations over an executor's shard, and the one merge function.

``ffn_partial`` and ``attn_partial`` compute an executor's share of a layer; partial outputs
over disjoint neuron / head sets add up to the dense layer, which ``add_partials`` does (with
the biases that belong to the whole layer added exactly once).

Predictor policies (the coordinator chooses one per engine):
  predictor   the shard's active set per token comes from the predictor (logit >= threshold)
  gate-first  a SwiGLU model sparsified with per-layer thresholds (``sparsify``), no predictor:
              each device computes the gate of all its neurons, thresholds |SiLU(gate)| and
              reads up / down rows only of the neurons above the threshold (exact)
  oracle      the true activations: the shard computes its own gate/up once to find them
              (test-only: checks the sparse path against dense without predictor error)
  dense       every neuron of the shard, for models without predictors (a sparsified model's
              thresholds unused: the dense baseline)
A sparsified SwiGLU model's thresholds apply under 'predictor' too (the predicted mode): the
predicted neurons' h is zeroed where the criterion is not above the threshold, so predicted
neurons that the threshold rejects contribute nothing, as in the thresholded dense model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.cpu_ffn import sparse_ffn_bitmask
from ..kernels.linear import linear
from ..kernels.predictor import active_of
from ..kernels.quant import dequantize, round_q8_0
from ..kernels.sparse_ffn import sparse_ffn, takes_gemm
from ..kernels.torch_ffn import sparse_ffn_gemm
from ..model.config import ModelConfig
from ..model.reference import ffn_activation, threshold_criterion
from .shard import AttnShard, FFNShard

POLICIES = ("predictor", "gate-first", "oracle", "dense")


@dataclass(frozen=True)
class Policy:
    """How an executor finds a layer's active neurons: a name of POLICIES, the predictor's
    threshold (neuron j is active iff its logit >= threshold) and a sparsified SwiGLU model's
    activation thresholds (per layer; empty: none apply) with their criterion."""

    name: str
    threshold: float = 0.0
    act_thresholds: tuple[float, ...] = ()
    act_on: str = "gate"

    @classmethod
    def for_model(cls, name: str, threshold: float | None, cfg: ModelConfig, margin: float = 0.0) -> "Policy":
        """The policy for a model; threshold None: the model's own (``powerinfer.sparse_threshold``),
        lowered by ``margin`` (> 0: more neurons)."""
        check_policy(name, cfg)
        thr = cfg.sparse_threshold if threshold is None else threshold
        acts = cfg.ffn_thresholds if name != "dense" else ()
        return cls(name, (0.0 if thr is None else float(thr)) - margin, acts, cfg.ffn_threshold_on)

    def act_threshold(self, l: int) -> float | None:
        """Layer l's SwiGLU activation threshold, or None (no thresholds, or policy 'dense')."""
        return self.act_thresholds[l] if self.act_thresholds else None


def check_policy(name: str, cfg: ModelConfig) -> None:
    """ValueError unless the model can run under policy ``name``."""
    model = cfg.name or "this model"
    if name not in POLICIES:
        raise ValueError(f"policy {name!r}: expected one of {POLICIES}")
    if name == "predictor" and not cfg.has_predictors:
        raise ValueError(f"policy 'predictor' needs a model with predictors; {model} has no predictors: train "
                         "them (powerinfer-ray train-predictors) or use policy " +
                         ("'gate-first'" if cfg.thresholded else "'dense'"))
    if name == "gate-first" and not cfg.thresholded:
        raise ValueError(f"policy 'gate-first' needs a SwiGLU model sparsified with per-layer thresholds; {model} "
                         "has no thresholds: run powerinfer-ray sparsify (SwiGLU models), or use policy 'predictor' "
                         "or 'dense'")
    if name == "gate-first" and cfg.ffn_threshold_on != "gate":
        raise ValueError(f"policy 'gate-first' thresholds |SiLU(gate)| before reading up rows; {model} was "
                         f"sparsified on |h| (ffn_threshold_on={cfg.ffn_threshold_on!r}): sparsify it again with "
                         "--on gate, or use policy 'predictor' (after train-predictors) or 'oracle'")


def default_policy(cfg: ModelConfig) -> str:
    """The policy a model's metadata selects: gate-first for a model sparsified on |SiLU(gate)|
    (with predictors too: on every SwiGLU model measured they marked ~90 % of the neurons, where
    gate-first reads the gate rows and ~half the others; bench/RESULTS.md), else its predictors,
    else the exact oracle for one sparsified on |h|, else dense."""
    if cfg.thresholded and cfg.ffn_threshold_on == "gate":
        return "gate-first"
    if cfg.has_predictors:
        return "predictor"
    return "oracle" if cfg.thresholded else "dense"


def active_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bool mask [T, n] -> (idx [K] of rows active for any token, per-token mask [T, K] or None
    when T == 1, where every listed row is active)."""
    idx = mask.any(0).nonzero().reshape(-1)  # [K]
    return idx, (None if mask.shape[0] == 1 else mask.index_select(1, idx))


def oracle_mask(x: torch.Tensor, shard: FFNShard, act: str, act_threshold: float | None = None,
                act_on: str = "gate") -> torch.Tensor:
    """The true activity [T, n] of the shard's neurons for inputs x [T, D]: h != 0, or with a
    SwiGLU activation threshold the criterion above it (the thresholded model's), as the kernels
    compute it: on quantized rows of a CPU shard, of x rounded to Q8_0 (what the CPU kernel
    multiplies)."""
    gate, h = _shard_h(x, shard, act)
    return h != 0 if act_threshold is None else threshold_criterion(act_on, gate, h) > act_threshold


def shard_activation(x: torch.Tensor, shard: FFNShard, act: str, act_threshold: float | None = None,
                     act_on: str = "gate") -> torch.Tensor:
    """The activations h [T, n] (fp32) of the shard's neurons for inputs x [T, D], computed as
    ``oracle_mask`` computes them; with a SwiGLU activation threshold, zero where the criterion
    is not above it (the thresholded model's h)."""
    gate, h = _shard_h(x, shard, act)
    if act_threshold is None:
        return h
    return torch.where(threshold_criterion(act_on, gate, h) > act_threshold, h, torch.zeros((), device=h.device))


def _shard_h(x: torch.Tensor, shard: FFNShard, act: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(gate [T, n] or None, h [T, n]) of the shard's neurons, fp32 (``oracle_mask``'s rounding)."""
    q = shard.qtype
    xf = x.float() if q is None or x.is_cuda else round_q8_0(x).float()
    sel = None if shard.rows is None else shard.rows.long()
    pick = lambda t: t if sel is None else t[sel]  # noqa: E731  (the shard's neurons' rows, in order)
    rows = lambda w: pick(w).float() if q is None else dequantize(pick(w), q)  # noqa: E731
    up = xf @ rows(shard.up).T  # [T, n]
    if shard.up_bias is not None:
        up = up + pick(shard.up_bias)
    gate = xf @ rows(shard.gate).T if shard.gate is not None else None  # [T, n]
    return gate, ffn_activation(act, up, gate)


def ffn_partial(x: torch.Tensor, shard: FFNShard, act: str, policy: str,
                mask: torch.Tensor | None = None, out: torch.Tensor | None = None,
                threads: int | None = None, act_threshold: float | None = None,
                act_on: str = "gate", count: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
    """The shard's FFN output y [T, D] for x [T, D] (without the down bias), the number of
    (token, neuron) pairs computed, and the number of neuron rows read (each once per call; under
    gate-first the rows above the threshold, besides the gate rows of all n, see ``ffn_bytes``).
    ``mask`` [T, n] bool is the predicted activity (policy 'predictor'); act_threshold, act_on:
    the layer's SwiGLU activation threshold (``Policy.act_threshold``); count [n] int64: policy
    'oracle' adds the tokens in which each neuron is active into it (``activity``)."""
    T = x.shape[0]
    if shard.n == 0:
        y = out.zero_() if out is not None else torch.zeros_like(x)
        return y, 0, 0
    if policy == "gate-first":
        return gate_first_ffn(x, shard, act, act_threshold, out, threads)
    gemm = takes_gemm(x)  # sparse_ffn's path for a prompt chunk: every row read once
    if policy == "oracle" and gemm and shard.rows is None:  # h once, the active rows counted where computed
        hits = torch.zeros(shard.n, dtype=torch.int64, device=x.device)
        y = sparse_ffn_gemm(x, shard.up, shard.gate, shard.down_t, None, None, act, shard.up_bias, out, shard.qtype,
                            act_threshold, act_on, count=hits)
        if count is not None:
            count += hits.to(count.device)
        return y, int(hits.sum()), shard.n
    if policy == "oracle":  # the exact mask: no threshold in the kernel, whose rounding may differ
        mask, act_threshold = oracle_mask(x, shard, act, act_threshold, act_on), None
        if count is not None:
            count += mask.sum(0).to(count.device)
    if policy == "dense":
        mask = None  # every neuron, every token
    if gemm and shard.rows is None:  # every row multiplied: the mask zeroes h, no active list (a sync) needed
        pairs = T * shard.n if mask is None else int(mask.sum())
        y = sparse_ffn_gemm(x, shard.up, shard.gate, shard.down_t, None, mask, act, shard.up_bias, out, shard.qtype,
                            act_threshold, act_on)
        return y, pairs, shard.n
    if mask is None:
        idx = torch.arange(shard.n, device=x.device)
        tok_mask, computed = None, T * shard.n
    else:
        idx, tok_mask = active_rows(mask)
        computed = int(mask.sum()) if tok_mask is not None else idx.numel()
    y = sparse_ffn(x, shard.up, shard.gate, shard.down_t, shard.row_index(idx), tok_mask, act, shard.up_bias,
                   out, threads=threads, qtype=shard.qtype, act_threshold=act_threshold, act_on=act_on)
    return y, computed, shard.n if gemm else idx.numel()


def gate_first_ffn(x: torch.Tensor, shard: FFNShard, act: str, t: float, out: torch.Tensor | None = None,
                   threads: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Gate-first over the shard (``ffn_partial``'s returns): on the CPU one kernel call walks every
    row, gate first, and reads up / down rows only where |SiLU(g)| > t for some token; on a GPU
    the gate of all rows is one GEMV, its threshold gives the active rows and the sparse kernel
    takes their gate values from it (``gate_pre``: no gate row is read twice)."""
    if x.device.type == "cpu":
        y = out if out is not None else torch.empty(x.shape, dtype=x.dtype)
        pairs, _, _, up_rows = sparse_ffn_bitmask(x.contiguous(), shard.up, shard.gate, shard.down_t, None, shard.n,
                                                  act, shard.up_bias, y, threads, qtype=shard.qtype, rows=shard.rows,
                                                  act_threshold=t)
        return y, pairs, up_rows
    assert not shard.in_place, "a GPU shard holds its own rows"
    g = linear(x, shard.gate, qtype=shard.qtype)  # [T, n] fp32
    mask = active_of(g, t, silu=True)  # [T, n]
    idx, tok_mask = active_rows(mask)
    y = sparse_ffn(x, shard.up, None, shard.down_t, idx, tok_mask, act, shard.up_bias, out, qtype=shard.qtype,
                   gate_pre=g)
    return y, int(mask.sum()), idx.numel()


def ffn_bytes(cfg: ModelConfig, gate_rows: int, up_rows: int, down_rows: int) -> int:
    """Weight bytes of FFN rows read: gate rows (none without a gate), up rows and down rows, each
    a row of the model's storage (gate-first reads the gate rows of all of a shard's neurons and
    the up / down rows of the active ones)."""
    row = cfg.neuron_bytes // (3 if cfg.gated else 2)
    return row * ((gate_rows if cfg.gated else 0) + up_rows + down_rows)


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


def add_partials(h: torch.Tensor, parts: list[torch.Tensor | None], bias: torch.Tensor | None = None) -> torch.Tensor:
    """h += the partial outputs [T, D] of disjoint shards (None = a shard with nothing to add) and
    the layer's output bias once, in place in the fp32 residual h (returned): one add per part,
    whatever its dtype (the add converts). This is where executors' results meet."""
    assert any(p is not None for p in parts), "add_partials needs at least one partial output"
    for p in parts:
        if p is not None:
            h += p
    if bias is not None:
        h += bias
    return h
