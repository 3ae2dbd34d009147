"""HF checkpoint -> PowerInfer-compatible GGUF model file.

Reads an HF model folder (``config.json``, safetensors, single file or sharded with
``model.safetensors.index.json``, ``tokenizer.json`` + ``tokenizer_config.json``) and, optionally,
upstream PowerInfer's per-layer predictors (``model_{l}.pt``), and streams a GGUF file: each tensor
is read from the checkpoint only when the writer reaches it, so models larger than RAM convert.

Layouts written (see gguf_keys): FFN neuron j is row j of ``ffn_up`` / ``ffn_gate`` /
``ffn_down_t``; llama's Q and K rows are permuted as llama.cpp's converter does, so that GGML's
mode-0 ("norm") RoPE, which the reference uses for llama, equals HF's ``rotate_half``; falcon's
fused ``query_key_value`` is split into q / k / v with query head h reading KV group h // n_gqa.

Architectures: LlamaForCausalLM (ReLU -> ReGLU, SiLU -> SwiGLU, dReLU), OPTForCausalLM (pre-LN,
ReLU), FalconForCausalLM (ReLU, rotary, parallel or sequential attention, old and new decoder
architectures).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from ..model import gguf_keys as K
from ..model.config import ConfigError, ModelConfig
from ..model.gguf_writer import LazyTensor, TensorLike, write_model
from ..model.tokenizer import hf_tokenizer_fields

log = logging.getLogger(__name__)

OUTTYPES = ("f16", "bf16", "f32")
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32}  # llama.cpp's general.file_type (LlamaFileType)
_MISSING = object()


class ConvertError(ValueError):
    """An HF checkpoint that cannot be converted; the message names the file and the field."""


# ------------------------------------------------------------------------------------------------
# inputs: config.json and the safetensors checkpoint
# ------------------------------------------------------------------------------------------------
@dataclass
class HFConfig:
    """config.json of an HF model, with errors that name the file and the field."""

    path: Path
    data: dict[str, Any]

    @classmethod
    def read(cls, hf_dir: Path) -> "HFConfig":
        path = hf_dir / "config.json"
        if not path.is_file():
            raise ConvertError(f"{path}: no such file; expected an HF model folder with config.json "
                               "and safetensors weights")
        try:
            return cls(path, json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{path}: not valid JSON ({exc})") from None

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """The first of ``names`` present (aliases, e.g. falcon's 'n_head'), else ``default``."""
        for n in names:
            if self.data.get(n) is not None:
                return self.data[n]
        if default is _MISSING:
            raise ConvertError(f"{self.path}: field {names[0]!r} is missing")
        return default

    def error(self, name: str, got: Any, expected: str) -> ConvertError:
        return ConvertError(f"{self.path}: {name} is {got!r}; {expected}")

    def require(self, name: str, ok: bool, got: Any, expected: str) -> None:
        if not ok:
            raise self.error(name, got, expected)


class Checkpoint:
    """The safetensors tensors of an HF model folder, opened lazily, one tensor at a time."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = hf_dir
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self._files():
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    self.file_of[name] = path
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())
        self._cached: tuple[str, torch.Tensor] | None = None
        self.used: set[str] = set()  # names the plan reads

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index}: field 'weight_map' is missing or empty")
            files = sorted({self.dir / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ConvertError(f"{index}: lists shard {f.name!r}, which is missing from {self.dir}")
            return files
        single = self.dir / "model.safetensors"
        if single.is_file():
            return [single]
        raise ConvertError(f"{self.dir}: no model.safetensors or model.safetensors.index.json (PyTorch "
                           ".bin checkpoints are not supported: re-save with save_pretrained(..., "
                           "safe_serialization=True))")

    def name(self, hf_name: str) -> str:
        """The stored name of ``hf_name``, with or without the 'model.' prefix of *ForCausalLM."""
        for cand in (hf_name, "model." + hf_name, hf_name.removeprefix("model.")):
            if cand in self.file_of:
                return cand
        raise ConvertError(f"{self.dir}: missing tensor {hf_name!r} in the checkpoint "
                           f"({len(self.file_of)} tensors in {sorted({p.name for p in self.file_of.values()})})")

    def has(self, hf_name: str) -> bool:
        try:
            self.name(hf_name)
        except ConvertError:
            return False
        return True

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return self.shapes[self.name(hf_name)]

    def load(self, hf_name: str) -> torch.Tensor:
        """One tensor from its shard (the last one stays cached: falcon splits it three ways)."""
        name = self.name(hf_name)
        if self._cached is None or self._cached[0] != name:
            with safe_open(self.file_of[name], framework="pt") as f:
                self._cached = (name, f.get_tensor(name))
        return self._cached[1]

    def lazy(self, hf_name: str, outtype: str, fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
             shape: tuple[int, ...] | None = None) -> LazyTensor:
        """A tensor read (and transformed by ``fn``) when the writer reaches it; matrices are
        stored at ``outtype``, 1-D tensors (norms, biases) at f32."""
        shape = tuple(shape if shape is not None else self.shape(hf_name))
        kind = outtype if len(shape) >= 2 else "f32"
        self.used.add(self.name(hf_name))
        return LazyTensor(shape, kind, lambda: fn(self.load(hf_name)) if fn else self.load(hf_name))

    def warn_unused(self) -> None:
        """Tensors of the checkpoint that no GGUF tensor reads, beyond the known redundant ones,
        mean the model has parts this converter does not know: say so."""
        redundant = re.compile(r".*rotary_emb\.inv_freq|(model\.)?lm_head\.weight")  # buffers; tied head
        unused = sorted(n for n in self.file_of if n not in self.used and not redundant.fullmatch(n))
        if unused:
            log.warning("%s: %d checkpoint tensors are not converted: %s", self.dir, len(unused),
                        ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else ""))


def _const(shape: tuple[int, ...], value: float) -> LazyTensor:
    """A constant 1-D tensor (OPT's LayerNorm without elementwise affine: weight 1, bias 0)."""
    return LazyTensor(shape, "f32", lambda: torch.full(shape, value, dtype=torch.float32))


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


def _llama_config(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> ModelConfig:
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
        arch="llama", ffn_act=LLAMA_ACTS[act.lower()], n_vocab=ck.shape("model.embed_tokens.weight")[0],
        n_embd=D, n_layer=int(hf.get("num_hidden_layers")), n_head=H, n_head_kv=G,
        n_ff=int(hf.get("intermediate_size")), n_ctx=int(hf.get("max_position_embeddings", default=2048)),
        norm_eps=float(hf.get("rms_norm_eps", default=1e-6)), rope_theta=rope_theta(hf),
        tied_output=bool(hf.get("tie_word_embeddings", default=False)), dtype=outtype, name=name)


def plan_llama(hf: HFConfig, ck: Checkpoint, outtype: str, name: str) -> Plan:
    """LlamaForCausalLM: RMSNorm, RoPE (Q/K permuted for GGML mode 0), GQA, gated FFN."""
    cfg = _llama_config(hf, ck, outtype, name)
    H, G = cfg.n_head, cfg.n_head_kv
    p = Plan(cfg)
    p.tensors[K.global_tensor(K.TOKEN_EMBD)] = ck.lazy("model.embed_tokens.weight", outtype)
    p.tensors[K.global_tensor(K.OUTPUT_NORM)] = ck.lazy("model.norm.weight", outtype)
    if not cfg.tied_output:
        p.tensors[K.global_tensor(K.OUTPUT)] = ck.lazy("lm_head.weight", outtype)
    for l in range(cfg.n_layer):
        hl = f"model.layers.{l}."
        t = {K.ATTN_NORM: ck.lazy(hl + "input_layernorm.weight", outtype),
             K.ATTN_Q: ck.lazy(hl + "self_attn.q_proj.weight", outtype, lambda w: permute_qk(w, H)),
             K.ATTN_K: ck.lazy(hl + "self_attn.k_proj.weight", outtype, lambda w: permute_qk(w, G)),
             K.ATTN_V: ck.lazy(hl + "self_attn.v_proj.weight", outtype),
             K.ATTN_OUT: ck.lazy(hl + "self_attn.o_proj.weight", outtype),
             K.FFN_NORM: ck.lazy(hl + "post_attention_layernorm.weight", outtype),
             K.FFN_UP: ck.lazy(hl + "mlp.up_proj.weight", outtype),
             K.FFN_GATE: ck.lazy(hl + "mlp.gate_proj.weight", outtype),
             K.FFN_DOWN_T: _transposed(ck, hl + "mlp.down_proj.weight", outtype)}
        p.tensors.update({K.tensor(tmpl, l): v for tmpl, v in t.items()})
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
        p.tensors[names[0]] = _const((p.cfg.n_embd,), 1.0)
        p.tensors[names[1]] = _const((p.cfg.n_embd,), 0.0)


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
    "LlamaForCausalLM": plan_llama, "OPTForCausalLM": plan_opt,
    "FalconForCausalLM": plan_falcon, "RWForCausalLM": plan_falcon,
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM",
               "RefinedWeb": "FalconForCausalLM", "RefinedWebModel": "FalconForCausalLM"}


def planner_for(hf: HFConfig) -> Callable[[HFConfig, Checkpoint, str, str], Plan]:
    archs = hf.get("architectures", default=None) or [MODEL_TYPES.get(hf.get("model_type", default=""), "?")]
    for a in archs:
        if a in PLANNERS:
            return PLANNERS[a]
    raise hf.error("architectures", archs, f"supported: {sorted(PLANNERS)}")


# ------------------------------------------------------------------------------------------------
# predictors: upstream PowerInfer's model_{l}.pt
# ------------------------------------------------------------------------------------------------
_PREDICTOR_FILE = re.compile(r"model_(\d+)\.pt")


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # not a zip-format file: mmap is unavailable
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ConvertError(f"{path}: expected a state dict with 'fc1.weight' and 'fc2.weight', "
                           f"got a {type(sd).__name__}")
    return sd


def predictor_files(pred_dir: Path, n_layer: int) -> list[Path]:
    """model_0.pt .. model_{n_layer-1}.pt, sorted numerically; one clear error when any is missing."""
    if not pred_dir.is_dir():
        raise ConvertError(f"{pred_dir}: no such predictor folder")
    found = {int(m.group(1)): p for p in pred_dir.iterdir() if (m := _PREDICTOR_FILE.fullmatch(p.name))}
    missing = [l for l in range(n_layer) if l not in found]
    extra = sorted(l for l in found if l >= n_layer)
    if missing or extra:
        raise ConvertError(f"{pred_dir}: expected predictor files model_0.pt .. model_{n_layer - 1}.pt "
                           f"(one per layer); missing layers {missing}, unexpected layers {extra}")
    return [found[l] for l in range(n_layer)]


def predictor_rank(path: Path, cfg: ModelConfig) -> int:
    """The width r of one predictor file, after checking fc1 [r, n_embd] and fc2 [n_ff, r]."""
    sd = _load_state(path)
    if "fc1.weight" not in sd or "fc2.weight" not in sd:
        raise ConvertError(f"{path}: keys {sorted(sd)}, expected 'fc1.weight' and 'fc2.weight'")
    if any(k.endswith(".bias") for k in sd):
        raise ConvertError(f"{path}: has biases {sorted(k for k in sd if k.endswith('.bias'))}; "
                           "PowerInfer predictors are bias-free")
    fc1, fc2 = tuple(sd["fc1.weight"].shape), tuple(sd["fc2.weight"].shape)
    r = fc1[0] if len(fc1) == 2 else -1
    if fc1 != (r, cfg.n_embd) or fc2 != (cfg.n_ff, r):
        raise ConvertError(f"{path}: fc1.weight {list(fc1)} / fc2.weight {list(fc2)}, expected "
                           f"[r, n_embd={cfg.n_embd}] / [n_ff={cfg.n_ff}, r]")
    return r


def add_predictors(p: Plan, pred_dir: Path, outtype: str) -> Plan:
    """fc1 / fc2 of every layer, their ranks and the sparse threshold (the predictor folder's
    config.json 'sparse_threshold' as upstream reads it, default 0.0) into the plan."""
    files = predictor_files(pred_dir, p.cfg.n_layer)
    ranks = tuple(predictor_rank(f, p.cfg) for f in files)
    thr_file = pred_dir / "config.json"
    thr = json.loads(thr_file.read_text()).get("sparse_threshold") if thr_file.is_file() else None
    p.cfg = p.cfg.with_(predictor_ranks=ranks, sparse_threshold=float(thr if thr is not None else 0.0))
    for l, (f, r) in enumerate(zip(files, ranks)):
        for tmpl, key, shape in ((K.FC1, "fc1.weight", (r, p.cfg.n_embd)), (K.FC2, "fc2.weight", (p.cfg.n_ff, r))):
            p.tensors[K.tensor(tmpl, l)] = LazyTensor(shape, outtype, lambda f=f, key=key: _load_state(f)[key])
    return p


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------
def _chat_template(hf_dir: Path, tok_config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template, or chat_template.jinja / .json beside it."""
    t = tok_config.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    if isinstance(t, str):
        return t
    if (hf_dir / "chat_template.jinja").is_file():
        return (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (hf_dir / "chat_template.json").is_file():
        return json.loads((hf_dir / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return None


def tokenizer_metadata(hf_dir: Path, hf: HFConfig, n_vocab: int) -> dict[str, Any]:
    """GGUF tokenizer fields from tokenizer.json (+ tokenizer_config.json); {} without a tokenizer."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        log.warning("%s: no tokenizer.json; the model file will have no tokenizer (prompts must be "
                    "token ids). A folder with only tokenizer.model gets one by re-saving the "
                    "tokenizer with transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d)", hf_dir)
        return {}
    cfg_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    fallback = {k: hf.data.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    try:
        fields = hf_tokenizer_fields(path.read_text(encoding="utf-8"), tok_config,
                                     _chat_template(hf_dir, tok_config), n_vocab, fallback)
    except (ValueError, KeyError) as exc:
        raise ConvertError(f"{path}: cannot convert the tokenizer ({exc})") from None
    n_tok = len(fields.get(K.TOK_TOKENS) or [])
    if n_tok > n_vocab:
        log.warning("%s: %d tokens but the embedding has %d rows; ids >= %d cannot be run",
                    path, n_tok, n_vocab, n_vocab)
    return fields


# ------------------------------------------------------------------------------------------------
# the converter
# ------------------------------------------------------------------------------------------------
def with_progress(tensors: dict[str, TensorLike], desc: str) -> tuple[dict[str, TensorLike], Any]:
    """The same tensors, each lazy one ticking a tqdm bar (unit: tensor) when it is produced."""
    from tqdm import tqdm

    bar = tqdm(total=len(tensors), desc=desc, unit="tensor")

    def ticking(name: str, t: LazyTensor) -> LazyTensor:
        def make() -> Any:
            bar.set_postfix_str(name, refresh=False)
            out = t.make()
            bar.update(1)
            return out
        return LazyTensor(t.shape, t.dtype, make)

    return {n: ticking(n, t) if isinstance(t, LazyTensor) else t for n, t in tensors.items()}, bar


def convert_hf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str = "f16",
               predictors_dir: str | os.PathLike[str] | None = None, sparse: bool | None = None,
               progress: bool = True) -> Path:
    """Convert the HF model in ``hf_dir`` into a GGUF model file at ``out_path``.

    ``outtype`` is the storage type of matrices (norms and biases stay f32); ``predictors_dir``
    holds upstream's per-layer ``model_{l}.pt`` predictors; ``sparse`` stamps the ``PWRI`` magic
    (default: when predictors are given). The file appears only once complete.
    """
    hf_dir, out = Path(hf_dir), Path(out_path)
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype is {outtype!r}, expected one of {OUTTYPES}")
    hf = HFConfig.read(hf_dir)
    ck = Checkpoint(hf_dir)
    try:
        plan = planner_for(hf)(hf, ck, outtype, hf_dir.resolve().name)
    except ConfigError as exc:  # sizes that contradict each other, e.g. heads not dividing hidden_size
        raise ConvertError(f"{hf.path}: {exc}") from None
    ck.warn_unused()
    if predictors_dir is not None:
        plan = add_predictors(plan, Path(predictors_dir), outtype)
    metadata = {K.FILE_TYPE: FILE_TYPE[outtype], **tokenizer_metadata(hf_dir, hf, plan.cfg.n_vocab)}
    tensors, bar = with_progress(plan.tensors, f"converting {hf_dir.name}") if progress else (plan.tensors, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    try:
        write_model(tmp, plan.cfg, tensors, metadata=metadata, sparse=sparse)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    return out
