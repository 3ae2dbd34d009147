"""A model's byte costs for the placement solver (placement may not import the model package,
so the model side builds them), from the size of every tensor as the primary executor holds it.

What the primary holds, and so what it costs: a matrix stored in Q8_0 / Q4_0 blocks as its
blocks; any other matrix (and a Q6_K ``output.weight``, dequantized at load) in the model's
float type (``ModelConfig.float_dtype``), or in ``dtype`` when the executor is given one (a CPU
primary converts to f32); the KV cache in that same float type; 1-D tensors (norms, biases)
in f32 (an upper bound for the q/k/v biases the executor keeps in the float type).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_config import expected_shapes
from .qtypes import BLOCK_BYTES, ELEMENT_BYTES, QK, QTYPES, storage_kind

if TYPE_CHECKING:
    from ..placement.costs import ModelCosts
    from .source import WeightSource


def model_costs(model: WeightSource | ModelConfig, n_ctx: int, batch: int,
                dtype: str | None = None, predictor_qtype: str | None = None, embd_on_host: bool = False) -> ModelCosts:
    """ModelCosts of ``model`` (a source, whose tensors' storage types are read, or a config,
    whose file would store them as ``quants.storage_kind`` says) with a KV cache for ``n_ctx``
    tokens x ``batch`` sequences, plus the executors' scratch slot (the cache row that padded
    decode rows write). ``dtype``: the float type the primary converts every weight to (None:
    as stored, see the module docstring). ``predictor_qtype``: the block type the primary
    quantizes float predictors to (``predictor_kind``; None: as stored). ``embd_on_host``: the
    token embedding lives in host memory (``Plan.embd_on_host``) and costs the budget nothing,
    unless it is also the output head (``embedding_apart``)."""
    from ..placement.costs import ModelCosts

    cfg = model if isinstance(model, ModelConfig) else model.config
    shapes = expected_shapes(cfg)
    float_kind = dtype or cfg.float_dtype
    predictors = {K.tensor(t, l) for t in (K.FC1, K.FC2) for l in range(cfg.n_layer)}

    def nbytes(name: str) -> int:
        """Bytes of tensor ``name`` as the primary holds it (0 when the model has none)."""
        if name not in shapes:
            return 0
        shape = shapes[name]
        if len(shape) == 1:
            return shape[0] * ELEMENT_BYTES["f32"]
        kind = _stored(model, cfg, name, shape)
        if name in predictors:
            kind = _held_predictor(kind, shape, predictor_qtype)
        return _bytes(kind if dtype is None and kind in QTYPES else float_kind, *shape)

    base = ModelCosts.from_shape(cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.n_vocab,
                                 cfg.gated, ELEMENT_BYTES[float_kind],
                                 list(cfg.predictor_ranks) or [0] * cfg.n_layer, n_ctx, batch + 1,
                                 kv_dtype_bytes=ELEMENT_BYTES[float_kind], tied_embeddings=cfg.tied_output,
                                 bias=cfg.bias)
    L, F, G = cfg.n_layer, cfg.n_ff, cfg.n_head_kv
    neuron_t = [(K.FFN_UP, False), (K.FFN_GATE, False), (K.FFN_DOWN_T, False), (K.FFN_UP, True)]
    attn_t = [(t, b) for t in (K.ATTN_Q, K.ATTN_K, K.ATTN_V) for b in (False, True)]
    pred_t = [(K.FC1, False), (K.FC2, False)]
    neuron = [sum(nbytes(K.tensor(t, l, b)) for t, b in neuron_t) // F for l in range(L)]
    attn = [sum(nbytes(K.tensor(t, l, b)) for t, b in attn_t) // G + _o_cols(cfg, model, l, float_kind, dtype)
            for l in range(L)]
    predictor = [sum(nbytes(K.tensor(t, l, b)) for t, b in pred_t) for l in range(L)]
    units = {K.tensor(t, l, b) for l in range(L) for t, b in neuron_t + attn_t + pred_t + [(K.ATTN_OUT, False)]}
    if embd_on_host and embedding_apart(model):
        units.add(K.global_tensor(K.TOKEN_EMBD))
    dense = sum(nbytes(n) for n in shapes if n not in units)  # embeddings, output head, norms, o/down biases
    return replace(base, neuron_bytes=tuple(neuron), attn_group_bytes=tuple(attn),
                   predictor_bytes=tuple(predictor), dense_bytes=dense)


def embedding_apart(model: WeightSource | ModelConfig) -> bool:
    """Whether the token embedding is not the output head: the model holds an untied head."""
    cfg = model if isinstance(model, ModelConfig) else model.config
    out = K.global_tensor(K.OUTPUT)
    held = out in expected_shapes(cfg) if isinstance(model, ModelConfig) else model.has(out)
    return held and not cfg.tied_output


def embedding_bytes(model: WeightSource | ModelConfig) -> int:
    """Bytes of the token embedding as the primary holds it: blocks as stored, else floats."""
    cfg = model if isinstance(model, ModelConfig) else model.config
    name = K.global_tensor(K.TOKEN_EMBD)
    shape = expected_shapes(cfg)[name]
    kind = _stored(model, cfg, name, shape)
    return _bytes(kind if kind in QTYPES else cfg.float_dtype, *shape)


def fitting_predictor_qtype(model: WeightSource | ModelConfig, n_ctx: int, batch: int,
                            budget_bytes: int, workspace_bytes: int | None = None) -> str | None:
    """How the primary should hold float predictors under ``budget_bytes``: as stored (None) when
    the budget holds the whole model with them; else as Q8_0 blocks, whose bytes saved go to hot
    FFN neurons (Q8_0's rounding leaves the predictors' masks as they were:
    bench/results/quant-quality-tiny.json, recall 0.9726 against 0.9728), or as Q4_0 when only Q4_0
    lets the budget hold all attention with its KV cache. Attention comes first because a head on
    the CPU costs far more per token than a predictor's rounding (``placement.problem``'s
    attention weight). workspace_bytes: the primary's beside weights and KV cache, as the engine
    plans it (None: ModelCosts' estimate)."""
    costs = {q: model_costs(model, n_ctx, batch, predictor_qtype=q, embd_on_host=True) for q in (None, "q8_0", "q4_0")}
    if workspace_bytes is not None:
        costs = {q: replace(c, workspace_bytes=workspace_bytes) for q, c in costs.items()}
    if costs["q4_0"].predictor_bytes == costs[None].predictor_bytes:
        return None  # stored as blocks already (or no predictors): nothing to quantize
    if costs[None].total_bytes <= budget_bytes:
        return None
    q8 = costs["q8_0"]
    return "q8_0" if q8.fixed_bytes + q8.attention_bytes <= budget_bytes else "q4_0"


def predictor_kind(model: WeightSource | ModelConfig, template: str, l: int, predictor_qtype: str | None) -> str:
    """How the primary holds predictor matrix ``template`` (FC1 / FC2) of layer l: blocks as a
    file stores them, else ``predictor_qtype`` blocks when given and its rows are whole blocks,
    else the stored float kind."""
    cfg = model if isinstance(model, ModelConfig) else model.config
    name = K.tensor(template, l)
    shape = expected_shapes(cfg)[name]
    return _held_predictor(_stored(model, cfg, name, shape), shape, predictor_qtype)


def _held_predictor(stored: str, shape: tuple[int, ...], predictor_qtype: str | None) -> str:
    if stored in QTYPES or predictor_qtype is None or shape[-1] % QK:
        return stored
    return predictor_qtype


def _stored(model: WeightSource | ModelConfig, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> str:
    """How the model stores tensor ``name``. Rows of q, k or v that a file holds in a fused
    ``attn_qkv`` are held as that tensor stores them (blocks stay blocks); an untransposed
    ``ffn_down``, whose neuron columns the executors convert, counts as float."""
    if isinstance(model, ModelConfig):
        return storage_kind(cfg.dtype, name, shape)
    if model.has(name):
        return model.dtype_of(name)
    fused = _fused_qkv(name)
    return model.dtype_of(fused) if fused is not None and model.has(fused) else cfg.float_dtype


def _fused_qkv(name: str) -> str | None:
    """The fused attn_qkv tensor that stands for q / k / v tensor ``name`` (blk.L.attn_q.weight),
    else None."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in ("attn_q", "attn_k", "attn_v"):
        return None
    return K.tensor(K.ATTN_QKV, int(parts[1]), parts[3] == "bias")


def _bytes(kind: str, rows: int, cols: int) -> int:
    """Bytes of rows x cols weights held as ``kind`` (block types: their share of the blocks
    when a slice of columns does not end on a block boundary)."""
    if kind in QTYPES:
        return math.ceil(rows * cols * BLOCK_BYTES[kind] / QK)
    return rows * cols * ELEMENT_BYTES[kind]


def _o_cols(cfg: ModelConfig, model: WeightSource | ModelConfig, l: int, float_kind: str,
            dtype: str | None) -> int:
    """The o-projection columns [D, n_gqa hd] of one KV-head group's heads."""
    name = K.tensor(K.ATTN_OUT, l)
    kind = _stored(model, cfg, name, (cfg.n_embd, cfg.n_head * cfg.head_dim))
    return _bytes(kind if dtype is None and kind in QTYPES else float_kind, cfg.n_embd, cfg.n_gqa * cfg.head_dim)
