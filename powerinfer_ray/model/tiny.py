"""Seeded tiny models of every supported architecture and FFN variant, written as GGUF in well
under a second: the fixtures of the test suite and the on-the-fly default model.

Tiny models use the byte-level vocabulary of ``tokenizer.byte_level_fields`` (256 byte tokens
plus <s> and </s>), so text round-trips through them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_config import expected_shapes
from .gguf_writer import write_model
from .tokenizer import BYTE_VOCAB_SIZE, byte_level_fields

VARIANTS = {
    "llama-reglu": dict(arch="llama", ffn_act="reglu"),
    "llama-drelu": dict(arch="llama", ffn_act="drelu"),
    "llama-relu": dict(arch="llama", ffn_act="relu"),
    "llama-swiglu": dict(arch="llama", ffn_act="swiglu"),
    "qwen2": dict(arch="qwen2", ffn_act="swiglu", qkv_bias=True, n_head=4, n_head_kv=2),
    "llama-gqa": dict(arch="llama", ffn_act="reglu", n_head=4, n_head_kv=2),
    "opt": dict(arch="opt", ffn_act="relu", bias=True, tied_output=True),
    "falcon": dict(arch="falcon", ffn_act="relu", parallel_attn=True, n_head=4, n_head_kv=1,
                   tied_output=True),
    "falcon-gqa": dict(arch="falcon", ffn_act="relu", parallel_attn=True, two_norms=True,
                       n_head=4, n_head_kv=2, tied_output=True),
}


def tiny_config(variant: str = "llama-reglu", *, n_embd: int = 64, n_layer: int = 2, n_ff: int = 256,
                n_ctx: int = 128, predictor_rank: int | None = None, dtype: str = "f32",
                **overrides) -> ModelConfig:
    """The config of a tiny model of ``variant`` (a key of VARIANTS)."""
    if variant not in VARIANTS:
        raise ValueError(f"tiny model variant {variant!r}: expected one of {sorted(VARIANTS)}")
    base = dict(n_vocab=BYTE_VOCAB_SIZE, n_embd=n_embd, n_layer=n_layer, n_head=4, n_head_kv=4,
                n_ff=n_ff, n_ctx=n_ctx, dtype=dtype, name=f"tiny-{variant}",
                norm_eps=1e-5, rope_theta=10000.0)
    base.update(VARIANTS[variant])
    if predictor_rank:
        base.update(predictor_ranks=(predictor_rank,) * n_layer, sparse_threshold=0.0)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the right shapes: matrices ~ N(0, 1/fan_in), norms ~ 1 + noise."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            base = 0.0 if name.endswith(".bias") else 1.0
            out[name] = base + 0.1 * torch.randn(shape, generator=g)
        elif name.startswith((K.TOKEN_EMBD, K.POS_EMBD)):
            out[name] = torch.randn(shape, generator=g)
        else:
            fan_in = cfg.n_ff if ".ffn_down_t." in name else shape[1]
            out[name] = torch.randn(shape, generator=g) / fan_in**0.5
    return out


def write_tiny_model(path: str | Path, variant: str = "llama-reglu", seed: int = 0,
                     sparse: bool | None = None, **cfg_kwargs) -> Path:
    """Write a seeded tiny model of ``variant`` to ``path`` and return the path."""
    cfg = tiny_config(variant, **cfg_kwargs)
    return write_model(path, cfg, tiny_weights(cfg, seed), metadata=byte_level_fields(), sparse=sparse)
