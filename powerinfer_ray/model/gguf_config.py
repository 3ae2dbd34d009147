"""GGUF metadata <-> ModelConfig, and the tensors (with shapes) a model file of a config holds.

``config_from_fields`` reads what a file's metadata (and the presence and shapes of its tensors)
describe; ``config_to_fields`` is its inverse; ``check_tensors`` raises one clear error for the
first tensor a file lacks or whose shape contradicts the metadata.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from . import gguf_keys as K
from .config import ARCHS, ConfigError, ModelConfig
from .qtypes import KIND_OF


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and the problem."""


_ARCH_ALIASES = {"bamboo": ("llama", "drelu")}


def config_from_fields(fields: Mapping[str, Any], tensors: Mapping[str, Any], sparse: bool,
                       path: Path | str = "<memory>") -> ModelConfig:
    """Build the ModelConfig that GGUF metadata (and tensor presence/shapes) describe."""
    arch_name = fields.get(K.ARCH)
    if arch_name is None:
        raise ModelFileError(f"{path}: metadata key {K.ARCH!r} is missing")
    arch, default_act = _ARCH_ALIASES.get(arch_name, (arch_name, None))
    if arch not in ARCHS:
        raise ModelFileError(f"{path}: unknown architecture {arch_name!r}; supported: llama "
                             "(ReGLU, dReLU, ReLU, SwiGLU), bamboo, qwen2 (SwiGLU), opt, falcon")

    def req(template: str) -> Any:
        k = K.key(template, arch_name)
        if k not in fields:
            raise ModelFileError(f"{path}: metadata key {k!r} is missing")
        return fields[k]

    def opt(template: str, default: Any) -> Any:
        return fields.get(K.key(template, arch_name), default)

    n_layer = int(req(K.BLOCK_COUNT))
    if default_act is None:
        default_act = {"llama": "reglu" if sparse else "swiglu", "qwen2": "swiglu"}.get(arch, "relu")
    embd = tensors.get(K.global_tensor(K.TOKEN_EMBD))
    n_vocab = opt(K.VOCAB_SIZE, None)
    if n_vocab is None:
        toks = fields.get(K.TOK_TOKENS)
        n_vocab = len(toks) if toks else (int(embd.shape[-1]) if embd is not None else 0)
    rms = arch in ("llama", "qwen2")
    eps_key = K.LAYERNORM_RMS_EPS if rms else K.LAYERNORM_EPS
    ranks = []
    for l in range(n_layer):
        fc1 = tensors.get(K.tensor(K.FC1, l))
        if fc1 is None:
            break
        ranks.append(int(fc1.data.shape[0]))
    if 0 < len(ranks) < n_layer:
        raise ModelFileError(f"{path}: predictors present for {len(ranks)} of {n_layer} layers "
                             f"(tensor {K.tensor(K.FC1, len(ranks))!r} is missing)")
    up = tensors.get(K.tensor(K.FFN_UP, 0))
    dtype = KIND_OF.get(up.tensor_type, "f32") if up is not None else "f32"
    thr = fields.get(K.SPARSE_THRESHOLD)
    n_head = int(req(K.HEAD_COUNT))
    n_rot = int(opt(K.ROPE_DIMENSION_COUNT, 0))
    qkv_bias = K.tensor(K.ATTN_Q, 0, bias=True) in tensors or K.tensor(K.ATTN_QKV, 0, bias=True) in tensors
    bias = qkv_bias and K.tensor(K.FFN_UP, 0, bias=True) in tensors  # every linear layer (opt, falcon)
    try:
        return ModelConfig(
            arch=arch, ffn_act=str(fields.get(K.FFN_ACT, default_act)),
            n_vocab=int(n_vocab), n_embd=int(req(K.EMBEDDING_LENGTH)), n_layer=n_layer,
            n_head=n_head, n_head_kv=int(opt(K.HEAD_COUNT_KV, n_head)),
            n_ff=int(req(K.FEED_FORWARD_LENGTH)), n_ctx=int(opt(K.CONTEXT_LENGTH, 2048)),
            norm_eps=_f32(opt(eps_key, 1e-6 if rms else 1e-5)),
            rope_theta=_f32(opt(K.ROPE_FREQ_BASE, 10000.0)), n_rot=n_rot,
            parallel_attn=bool(fields.get(K.PARALLEL_ATTN, arch == "falcon")),
            two_norms=K.tensor(K.ATTN_NORM_2, 0) in tensors,
            bias=bias, qkv_bias=qkv_bias and not bias,
            tied_output=K.global_tensor(K.OUTPUT) not in tensors,
            sparse_threshold=None if thr is None else _f32(thr),
            predictor_ranks=tuple(ranks), dtype=dtype, name=str(fields.get(K.NAME, "")),
            ffn_thresholds=tuple(fields.get(K.FFN_THRESHOLDS, ())),
            ffn_threshold_on=str(fields.get(K.FFN_THRESHOLD_ON, "gate")),
        )
    except ConfigError as exc:
        raise ModelFileError(f"{path}: {exc}") from None


def _f32(v: Any) -> float:
    """GGUF stores float32: undo the representation error (1e-5 reads as 9.99999975e-06)."""
    return float(f"{float(v):.7g}")


def config_to_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The GGUF metadata that describes ``cfg`` (inverse of ``config_from_fields``)."""
    a = cfg.arch
    f: dict[str, Any] = {
        K.NAME: cfg.name or f"{a}-{cfg.ffn_act}",
        K.key(K.CONTEXT_LENGTH, a): cfg.n_ctx,
        K.key(K.EMBEDDING_LENGTH, a): cfg.n_embd,
        K.key(K.BLOCK_COUNT, a): cfg.n_layer,
        K.key(K.FEED_FORWARD_LENGTH, a): cfg.n_ff,
        K.key(K.HEAD_COUNT, a): cfg.n_head,
        K.key(K.HEAD_COUNT_KV, a): cfg.n_head_kv,
        K.key(K.LAYERNORM_RMS_EPS if cfg.norm == "rms" else K.LAYERNORM_EPS, a): float(cfg.norm_eps),
        K.key(K.VOCAB_SIZE, a): cfg.n_vocab,
        K.FFN_ACT: cfg.ffn_act,
    }
    if cfg.rope_style is not None:
        f[K.key(K.ROPE_FREQ_BASE, a)] = float(cfg.rope_theta)
        f[K.key(K.ROPE_DIMENSION_COUNT, a)] = cfg.rot_dims
    if a == "falcon":
        f[K.PARALLEL_ATTN] = bool(cfg.parallel_attn)
    if cfg.sparse_threshold is not None:
        f[K.SPARSE_THRESHOLD] = float(cfg.sparse_threshold)
    if cfg.thresholded:
        f[K.FFN_THRESHOLDS] = list(cfg.ffn_thresholds)
        f[K.FFN_THRESHOLD_ON] = cfg.ffn_threshold_on
    return f


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a complete model file of ``cfg`` holds, with its numpy shape."""
    D, F, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    g = K.global_tensor
    s: dict[str, tuple[int, ...]] = {g(K.TOKEN_EMBD): (cfg.n_vocab, D), g(K.OUTPUT_NORM): (D,)}
    if cfg.norm == "layer":
        s[g(K.OUTPUT_NORM, bias=True)] = (D,)
    if not cfg.tied_output:
        s[g(K.OUTPUT)] = (cfg.n_vocab, D)
    if cfg.arch == "opt":
        s[g(K.POS_EMBD)] = (cfg.n_ctx + cfg.pos_offset, D)
    for l in range(cfg.n_layer):
        t = lambda tmpl, bias=False: K.tensor(tmpl, l, bias)  # noqa: E731
        mats = {K.ATTN_Q: (q, D), K.ATTN_K: (kv, D), K.ATTN_V: (kv, D), K.ATTN_OUT: (D, q),
                K.FFN_UP: (F, D), K.FFN_DOWN_T: (F, D)}
        if cfg.gated:
            mats[K.FFN_GATE] = (F, D)
        norms = [K.ATTN_NORM]
        if cfg.two_norms:
            norms.append(K.ATTN_NORM_2)
        elif not cfg.parallel_attn:
            norms.append(K.FFN_NORM)
        for tmpl, shape in mats.items():
            s[t(tmpl)] = shape
        for tmpl in norms:
            s[t(tmpl)] = (D,)
            if cfg.norm == "layer":
                s[t(tmpl, True)] = (D,)
        if cfg.has_qkv_bias:
            biased = ((K.ATTN_Q, q), (K.ATTN_K, kv), (K.ATTN_V, kv))
            if cfg.bias:
                biased += ((K.ATTN_OUT, D), (K.FFN_UP, F), (K.FFN_DOWN_T, D))
            for tmpl, n in biased:
                s[t(tmpl, True)] = (n,)
        if cfg.predictor_ranks:
            r = cfg.predictor_ranks[l]
            s[t(K.FC1)] = (r, D)
            s[t(K.FC2)] = (F, r)
    return s


# alternative layouts a reader accepts for a tensor our writer emits
def _alternatives(name: str, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blk":
        return []
    l, what, kind = int(parts[1]), parts[2], parts[-1]
    D, F, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    fused = (cfg.n_head + 2 * cfg.n_head_kv) * hd
    if what == "ffn_down_t" and kind == "weight":
        return [(K.tensor(K.FFN_DOWN, l), (D, F))]
    if what in ("attn_q", "attn_k", "attn_v"):
        return [(K.tensor(K.ATTN_QKV, l, kind == "bias"), (fused, D) if kind == "weight" else (fused,))]
    return []


def check_tensors(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], path: Path | str) -> None:
    """Raise one clear error for the first missing tensor or shape that contradicts metadata."""
    for name, shape in expected_shapes(cfg).items():
        if name in shapes:
            got = tuple(shapes[name])
            if got != shape:
                raise ModelFileError(f"{path}: tensor {name!r} has shape {list(got)}, expected "
                                     f"{list(shape)} from the metadata ({cfg.arch}, n_embd={cfg.n_embd}, "
                                     f"n_ff={cfg.n_ff}, n_head={cfg.n_head}, n_head_kv={cfg.n_head_kv})")
            continue
        for alt, alt_shape in _alternatives(name, cfg):
            if alt in shapes:
                if tuple(shapes[alt]) != alt_shape:
                    raise ModelFileError(f"{path}: tensor {alt!r} has shape {list(shapes[alt])}, "
                                         f"expected {list(alt_shape)} from the metadata")
                break
        else:
            raise ModelFileError(f"{path}: missing tensor {name!r} (shape {list(shape)}); the file "
                                 "is incomplete or was written for another architecture")

