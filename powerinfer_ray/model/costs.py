"""A model's byte costs for the placement solver (placement may not import the model package,
so the model side builds them)."""
from __future__ import annotations

from .config import ModelConfig


def model_costs(cfg: ModelConfig, n_ctx: int, batch: int):  # noqa: ANN201  (placement.ModelCosts)
    """ModelCosts of ``cfg`` with a KV cache for ``n_ctx`` tokens x ``batch`` sequences, plus the
    executors' scratch slot (the cache row that padded decode rows write)."""
    from ..placement.costs import ModelCosts

    return ModelCosts.from_shape(cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.n_vocab,
                                 cfg.gated, cfg.dtype_bytes, list(cfg.predictor_ranks) or [0] * cfg.n_layer,
                                 n_ctx, batch + 1, tied_embeddings=cfg.tied_output, bias=cfg.bias)
