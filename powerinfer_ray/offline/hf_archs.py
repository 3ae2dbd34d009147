"""HF architectures -> (ModelConfig, GGUF tensors): one planner per architecture, and the layout
transforms they share.

Layouts written (see gguf_keys): FFN neuron j is row j of ``ffn_up`` / ``ffn_gate`` /
``ffn_down_t``; llama's Q and K rows are permuted as llama.cpp's converter does, so that GGML's
mode-0 ("norm") RoPE, which the reference uses for llama, equals HF's ``rotate_half``; falcon's
fused ``query_key_value`` is split into q / k / v with query head h reading KV group h // n_gqa.

Architectures: LlamaForCausalLM and MistralForCausalLM (ReLU -> ReGLU, SiLU -> SwiGLU, dReLU),
Qwen2ForCausalLM (SwiGLU, q/k/v biases, NeoX RoPE: Q/K not permuted, as llama.cpp writes arch
qwen2), OPTForCausalLM (pre-LN, ReLU), FalconForCausalLM (ReLU, rotary, parallel or sequential
attention, old and new decoder architectures).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model import gguf_keys as K
from ..model.config import ModelConfig
from ..model.gguf_writer import LazyTensor, TensorLike
from .hf_checkpoint import Checkpoint, ConvertError, HFConfig, const


# ------------------------------------------------------------------------------------------------
# layout transforms
# ------------------------------------------------------------------------------------------------
def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF llama Q/K rows (rotate_half pairs i, i + hd/2) -> GGML mode-0 pairs (2i, 2i + 1), exactly
    as llama.cpp's converter permutes them. w [n_head * hd, D] (or a bias [n_head * hd])."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def transpose(w: torch.Tensor) -> torch.Tensor:
    """down_proj [D, F] -> ffn_down_t [F, D] (neuron j is row j)."""
    return w.T.contiguous()


def falcon_qkv_layout(hf: HFConfig) -> str:
    """'new' (new_decoder_architecture: per KV group, its query heads then k then v),
    'mq' (multi-query: all query heads, one k, one v) or 'mha' (per head q, k, v)."""
    # the original falcon-40b config (model_type RefinedWeb) predates the flag but has the layout
    if hf.get("new_decoder_architecture", default=hf.get("model_type", default="") == "RefinedWeb"):
        return "new"
    return "mq" if hf.get("multi_query", default=True) else "mha"


def split_falcon_qkv(w: torch.Tensor, layout: str, n_head: int, n_kv: int,
                     hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused query_key_value rows -> q [H hd, ...], k [G hd, ...], v [G hd, ...] in our head order
    (query head h uses KV group h // (H / G)). w is the weight [rows, D] or the bias [rows]."""
    rest = tuple(w.shape[1:])
    if layout == "new":
        x = w.reshape(n_kv, n_head // n_kv + 2, hd, *rest)  # [G, H/G + 2, hd, ...]
        q, k, v = x[:, :-2], x[:, -2], x[:, -1]
    elif layout == "mq":
        x = w.reshape(n_head + 2, hd, *rest)  # [H + 2, hd, ...]
        q, k, v = x[:-2], x[-2], x[-1]
    else:
        x = w.reshape(n_head, 3, hd, *rest)  # [H, 3, hd, ...]
        q, k, v = x[:, 0], x[:, 1], x[:, 2]
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------
# architectures: (ModelConfig, tensors) from config.json + checkpoint
# ------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What to write: the model config and its tensors by GGUF name, in writing order."""

    cfg: ModelConfig
    tensors: dict[str, TensorLike] = field(default_factory=dict)


def rope_theta(hf: HFConfig) -> float:
    """RoPE base: transformers 5 keeps it in rope_parameters, older configs at the top level.
    Scaled RoPE variants are rejected: the reference implements plain RoPE only."""
    params = hf.get("rope_parameters", default=None) or {}
    scaling = hf.get("rope_scaling", default=None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    where = "rope_parameters['rope_type']" if params.get("rope_type") else "rope_scaling"
    hf.require(where, kind == "default", kind, "only plain RoPE ('default') is supported")
    return float(params.get("rope_theta", hf.get("rope_theta", default=10000.0)))


LLAMA_ACTS = {"relu": "reglu", "silu": "swiglu", "swish": "swiglu", "drelu": "drelu"}


def _llama_config(hf: HFConfig, ck: Checkpoint, outtype: str, name: str, arch: str = "llama") -> ModelConfig:
    act = str(hf.get("hidden_act", default="silu"))
    hf.require("hidden_act", act.lower() in LLAMA_ACTS, act,
               "expected relu (ReGLU), silu (SwiGLU) or drelu")
    for flag in ("attention_bias", "mlp_bias"):
        hf.require(flag, not hf.get(flag, default=False), True, "llama biases are not supported")
    D, H = int(hf.get("hidden_size")), int(hf.get("num_attention_heads"))
    G = int(hf.get("num_key_value_heads", default=H))
    hd = hf.get("head_dim", default=D // H)
    hf.require("head_dim", hd == D // H, hd, f"expected hidden_size / num_attention_heads = {D // H}")
    return ModelConfig(
        arch=arch, ffn_act=LLAMA_ACTS[act.lower()], n_vocab=ck.shape("model.embed_tokens.weight")[0],
        n_embd=D, n_layer=int(hf.get("num_hidden_layers")), n_head=H, n_head_kv=G,
        n_ff=int(hf.get("intermediate_size")), n_ctx=_context_length(hf),
        norm_eps=float(hf.get("rms_norm_eps", default=1e-6)), rope_theta=rope_theta(hf),
        tied_output=bool(hf.get("tie_word_embeddings", default=False)), dtype=outtype, name=name,
        qkv_bias=arch == "qwen2")


def _context_length(hf: HFConfig) -> int:
    """max_position_embeddings, capped at the sliding window where one applies (Mistral's
    sliding_window, Qwen2's use_sliding_window): within the window it equals full attention."""
    n_ctx = int(hf.get("max_position_embeddings", default=2048))
    windowed = hf.get("use_sliding_window", default=hf.get("model_type", default="") == "mistral") or \
        "sliding_attention" in (hf.get("layer_types", default=None) or [])
    window = hf.get("sliding_window", default=None)
    return min(n_ctx, int(window)) if windowed and window else n_ctx


def plan_llama(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> Plan:
    """LlamaForCausalLM: RMSNorm, RoPE (Q/K permuted for GGML mode 0), GQA, gated FFN."""
    return _plan_llama_layout(_llama_config(hf, ck, outtype, name), ck, outtype)


def plan_qwen2(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> Plan:
    """Qwen2ForCausalLM: llama's layout with q/k/v biases and NeoX RoPE (Q/K as HF stores them)."""
    return _plan_llama_layout(_llama_config(hf, ck, outtype, name, arch="qwen2"), ck, outtype)


def _plan_llama_layout(cfg: ModelConfig, ck: Checkpoint, outtype: str) -> Plan:
    H, G = cfg.n_head, cfg.n_head_kv
    qk = (lambda n: (lambda w: permute_qk(w, n))) if cfg.rope_style == "norm" else (lambda n: None)
    p = Plan(cfg)
    p.tensors[K.global_tensor(K.TOKEN_EMBD)] = ck.lazy("model.embed_tokens.weight", outtype)
    p.tensors[K.global_tensor(K.OUTPUT_NORM)] = ck.lazy("model.norm.weight", outtype)
    if not cfg.tied_output:
        p.tensors[K.global_tensor(K.OUTPUT)] = ck.lazy("lm_head.weight", outtype)
    for l in range(cfg.n_layer):
        hl = f"model.layers.{l}."
        t = {K.ATTN_NORM: ck.lazy(hl + "input_layernorm.weight", outtype),
             K.ATTN_Q: ck.lazy(hl + "self_attn.q_proj.weight", outtype, qk(H)),
             K.ATTN_K: ck.lazy(hl + "self_attn.k_proj.weight", outtype, qk(G)),
             K.ATTN_V: ck.lazy(hl + "self_attn.v_proj.weight", outtype),
             K.ATTN_OUT: ck.lazy(hl + "self_attn.o_proj.weight", outtype),
             K.FFN_NORM: ck.lazy(hl + "post_attention_layernorm.weight", outtype),
             K.FFN_UP: ck.lazy(hl + "mlp.up_proj.weight", outtype),
             K.FFN_GATE: ck.lazy(hl + "mlp.gate_proj.weight", outtype),
             K.FFN_DOWN_T: _transposed(ck, hl + "mlp.down_proj.weight", outtype)}
        p.tensors.update({K.tensor(tmpl, l): v for tmpl, v in t.items()})
        if cfg.qkv_bias:
            for tmpl, proj in ((K.ATTN_Q, "q_proj"), (K.ATTN_K, "k_proj"), (K.ATTN_V, "v_proj")):
                p.tensors[K.tensor(tmpl, l, True)] = ck.lazy(f"{hl}self_attn.{proj}.bias", outtype)
    return p


def _transposed(ck: Checkpoint, hf_name: str, outtype: str) -> LazyTensor:
    rows, cols = ck.shape(hf_name)
    return ck.lazy(hf_name, outtype, transpose, (cols, rows))


def _norm(ck: Checkpoint, p: Plan, tmpl: str, l: int | None, hf_prefix: str, outtype: str,
          affine: bool = True) -> None:
    """A LayerNorm's weight and bias (ones / zeros when the HF norm has no affine parameters)."""
    names = (K.global_tensor(tmpl), K.global_tensor(tmpl, True)) if l is None else \
        (K.tensor(tmpl, l), K.tensor(tmpl, l, True))
    if affine:
        p.tensors[names[0]] = ck.lazy(hf_prefix + ".weight", outtype)
        p.tensors[names[1]] = ck.lazy(hf_prefix + ".bias", outtype)
    else:
        p.tensors[names[0]] = const((p.cfg.n_embd,), 1.0)
        p.tensors[names[1]] = const((p.cfg.n_embd,), 0.0)


def _linear(ck: Checkpoint, p: Plan, tmpl: str, l: int, hf_prefix: str, outtype: str, bias: bool,
            down: bool = False) -> None:
    """A linear layer's weight (transposed for the down projection) and, when present, its bias."""
    w = hf_prefix + ".weight"
    p.tensors[K.tensor(tmpl, l)] = _transposed(ck, w, outtype) if down else ck.lazy(w, outtype)
    if bias:
        p.tensors[K.tensor(tmpl, l, True)] = ck.lazy(hf_prefix + ".bias", outtype)


def _opt_config(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> ModelConfig:
    act = hf.get("activation_function", default="relu")
    hf.require("activation_function", act == "relu", act, "expected relu (OPT's sparse FFN)")
    hf.require("do_layer_norm_before", hf.get("do_layer_norm_before", default=True), False,
               "only pre-LayerNorm OPT is supported (opt-350m applies it after)")
    hf.require("_remove_final_layer_norm", not hf.get("_remove_final_layer_norm", default=False), True,
               "a final layer norm is required")
    D = int(hf.get("hidden_size"))
    proj = hf.get("word_embed_proj_dim", default=D)
    hf.require("word_embed_proj_dim", proj == D, proj, f"expected hidden_size = {D} (no project_in/out)")
    H = int(hf.get("num_attention_heads"))
    return ModelConfig(
        arch="opt", ffn_act="relu", n_vocab=ck.shape("model.decoder.embed_tokens.weight")[0], n_embd=D,
        n_layer=int(hf.get("num_hidden_layers")), n_head=H, n_head_kv=H, n_ff=int(hf.get("ffn_dim")),
        n_ctx=int(hf.get("max_position_embeddings")), norm_eps=1e-5,  # torch LayerNorm's default
        bias=bool(hf.get("enable_bias", default=True)),
        tied_output=bool(hf.get("tie_word_embeddings", default=True)), dtype=outtype, name=name)


def plan_opt(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> Plan:
    """OPTForCausalLM: pre-LN, learned positions (offset 2), biases, ReLU FFN, tied head."""
    cfg = _opt_config(hf, ck, outtype, name)
    bias, affine = cfg.bias, bool(hf.get("layer_norm_elementwise_affine", default=True))
    p = Plan(cfg)
    dec = "model.decoder."
    p.tensors[K.global_tensor(K.TOKEN_EMBD)] = ck.lazy(dec + "embed_tokens.weight", outtype)
    p.tensors[K.global_tensor(K.POS_EMBD)] = ck.lazy(dec + "embed_positions.weight", outtype)
    _norm(ck, p, K.OUTPUT_NORM, None, dec + "final_layer_norm", outtype, affine)
    if not cfg.tied_output:
        p.tensors[K.global_tensor(K.OUTPUT)] = ck.lazy("lm_head.weight", outtype)
    for l in range(cfg.n_layer):
        hl = f"{dec}layers.{l}."
        _norm(ck, p, K.ATTN_NORM, l, hl + "self_attn_layer_norm", outtype, affine)
        for tmpl, proj_name in ((K.ATTN_Q, "q_proj"), (K.ATTN_K, "k_proj"), (K.ATTN_V, "v_proj"),
                                (K.ATTN_OUT, "out_proj")):
            _linear(ck, p, tmpl, l, hl + "self_attn." + proj_name, outtype, bias)
        _norm(ck, p, K.FFN_NORM, l, hl + "final_layer_norm", outtype, affine)
        _linear(ck, p, K.FFN_UP, l, hl + "fc1", outtype, bias)
        _linear(ck, p, K.FFN_DOWN_T, l, hl + "fc2", outtype, bias, down=True)
    return p


def _falcon_config(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> tuple[ModelConfig, str]:
    act = hf.get("activation", default="gelu")
    hf.require("activation", act == "relu", act, "expected relu (Falcon-ReLU); GELU falcon is not sparse")
    hf.require("alibi", not hf.get("alibi", default=False), True, "only rotary falcon is supported")
    layout = falcon_qkv_layout(hf)
    parallel = bool(hf.get("parallel_attn", default=True))
    hf.require("parallel_attn", parallel or layout != "new", parallel,
               "the new decoder architecture needs parallel attention (as in transformers)")
    D, H = int(hf.get("hidden_size", "n_embed")), int(hf.get("num_attention_heads", "n_head"))
    G = {"new": int(hf.get("num_kv_heads", "n_head_kv", default=H)), "mq": 1, "mha": H}[layout]
    n_ln = hf.get("num_ln_in_parallel_attn", default=2 if layout == "new" else 1)
    cfg = ModelConfig(
        arch="falcon", ffn_act="relu", n_vocab=ck.shape("transformer.word_embeddings.weight")[0], n_embd=D,
        n_layer=int(hf.get("num_hidden_layers", "n_layer")), n_head=H, n_head_kv=G,
        n_ff=int(hf.get("ffn_hidden_size", default=4 * D)),
        n_ctx=int(hf.get("max_position_embeddings", default=2048)),
        norm_eps=float(hf.get("layer_norm_epsilon", default=1e-5)), rope_theta=rope_theta(hf),
        parallel_attn=parallel, two_norms=layout == "new" and n_ln == 2, bias=bool(hf.get("bias", default=False)),
        tied_output=bool(hf.get("tie_word_embeddings", default=True)), dtype=outtype, name=name)
    return cfg, layout


def plan_falcon(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> Plan:
    """FalconForCausalLM: LayerNorm, NeoX RoPE (no permutation), MQA/GQA, ReLU FFN."""
    cfg, layout = _falcon_config(hf, ck, outtype, name)
    p = Plan(cfg)
    p.tensors[K.global_tensor(K.TOKEN_EMBD)] = ck.lazy("transformer.word_embeddings.weight", outtype)
    _norm(ck, p, K.OUTPUT_NORM, None, "transformer.ln_f", outtype)
    if not cfg.tied_output:
        p.tensors[K.global_tensor(K.OUTPUT)] = ck.lazy("lm_head.weight", outtype)
    for l in range(cfg.n_layer):
        hl = f"transformer.h.{l}."
        if cfg.two_norms:
            _norm(ck, p, K.ATTN_NORM, l, hl + "ln_attn", outtype)
            _norm(ck, p, K.ATTN_NORM_2, l, hl + "ln_mlp", outtype)
        else:
            _norm(ck, p, K.ATTN_NORM, l, hl + "input_layernorm", outtype)
        _falcon_qkv(ck, p, l, hl + "self_attention.query_key_value", layout, outtype)
        _linear(ck, p, K.ATTN_OUT, l, hl + "self_attention.dense", outtype, cfg.bias)
        if not cfg.parallel_attn:
            _norm(ck, p, K.FFN_NORM, l, hl + "post_attention_layernorm", outtype)
        _linear(ck, p, K.FFN_UP, l, hl + "mlp.dense_h_to_4h", outtype, cfg.bias)
        _linear(ck, p, K.FFN_DOWN_T, l, hl + "mlp.dense_4h_to_h", outtype, cfg.bias, down=True)
    return p


def _falcon_qkv(ck: Checkpoint, p: Plan, l: int, hf_prefix: str, layout: str, outtype: str) -> None:
    c = p.cfg
    q_rows, kv_rows = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    fused = ck.shape(hf_prefix + ".weight")
    if fused != (q_rows + 2 * kv_rows, c.n_embd):
        raise ConvertError(f"{ck.dir}: tensor {hf_prefix + '.weight'!r} has shape {list(fused)}, expected "
                           f"{[q_rows + 2 * kv_rows, c.n_embd]} for the {layout!r} layout with "
                           f"n_head={c.n_head}, n_head_kv={c.n_head_kv}")
    for bias in (False, True) if c.bias else (False,):
        hf_name = hf_prefix + (".bias" if bias else ".weight")
        for i, (tmpl, rows) in enumerate(((K.ATTN_Q, q_rows), (K.ATTN_K, kv_rows), (K.ATTN_V, kv_rows))):
            split = lambda w, i=i: split_falcon_qkv(w, layout, c.n_head, c.n_head_kv, c.head_dim)[i]  # noqa: E731
            shape = (rows,) if bias else (rows, c.n_embd)
            p.tensors[K.tensor(tmpl, l, bias)] = ck.lazy(hf_name, outtype, split, shape)


PLANNERS: dict[str, Callable[[HFConfig, Checkpoint, str, str], Plan]] = {
    "LlamaForCausalLM": plan_llama, "MistralForCausalLM": plan_llama, "Qwen2ForCausalLM": plan_qwen2,
    "OPTForCausalLM": plan_opt,
    "FalconForCausalLM": plan_falcon, "RWForCausalLM": plan_falcon,
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM",
               "RefinedWeb": "FalconForCausalLM", "RefinedWebModel": "FalconForCausalLM"}


def planner_for(hf: HFConfig) -> Callable[[HFConfig, Checkpoint, str, str], Plan]:
    archs = hf.get("architectures", default=None) or [MODEL_TYPES.get(hf.get("model_type", default=""), "?")]
    for a in archs:
        if a in PLANNERS:
            return PLANNERS[a]
    raise hf.error("architectures", archs, f"supported: {sorted(PLANNERS)}")

