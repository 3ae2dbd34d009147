"""GGUF model files: a memory-mapped, lazy reader and a streaming writer.

The reader accepts standard GGUF and upstream PowerInfer files (magic ``PWRI``); tensors stay on
disk until a caller asks for them, and a caller can ask for a subset of rows, so an executor
loads only its neuron rows and attention heads. The writer stamps ``PWRI`` on sparse models
(models with predictors) unless told not to, and streams tensors one by one, so a model larger
than RAM can be written from a generator.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGUF_MAGIC as _GGUF_MAGIC_U32

from . import gguf_keys as K
from .config import ARCHS, ConfigError, ModelConfig

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32: ("f32", np.float32, torch.float32),
    GGMLQuantizationType.F16: ("f16", np.float16, torch.float16),
    GGMLQuantizationType.BF16: ("bf16", np.uint16, torch.bfloat16),
    GGMLQuantizationType.I32: ("i32", np.int32, torch.int32),
}
_GGML_OF = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
            "bf16": GGMLQuantizationType.BF16, "i32": GGMLQuantizationType.I32}
_TORCH_OF = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_PWRI_U32 = int.from_bytes(K.PWRI_MAGIC, "little")


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and the problem."""


class _Reader(GGUFReader):
    """gguf's reader, taught to accept upstream PowerInfer's ``PWRI`` magic."""

    def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001
        arr = super()._get(offset, dtype, count, override_order)
        if offset == 0 and count == 1 and len(arr) and int(arr[0]) == _PWRI_U32:
            return np.array([_GGUF_MAGIC_U32], dtype=arr.dtype)
        return arr


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
class ModelFile:
    """A GGUF model on disk: metadata, ``ModelConfig`` and lazy tensor access.

    ``get(name, rows)`` copies only the requested rows out of the memory map.
    """

    def __init__(self, path: str | os.PathLike[str], validate: bool = True) -> None:
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.magic = self.path.open("rb").read(4)
        self.fields: dict[str, Any] = {
            f.name: f.contents() for f in self.reader.fields.values() if not f.name.startswith("GGUF.")
        }
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.tensors.values():
            if t.tensor_type not in SUPPORTED_TYPES and _is_standard_down(t.name):
                raise self.error(f"tensor {t.name!r} is {t.tensor_type.name} in llama.cpp's layout "
                                 "(neuron j's down weights are column j of a quantized row-major "
                                 "matrix, which cannot be read by neuron): convert the HF checkpoint "
                                 "with `powerinfer-ray convert` (it stores ffn_down_t, a row per neuron)")
            if t.tensor_type not in SUPPORTED_TYPES:
                raise self.error(f"tensor {t.name!r} has type {t.tensor_type.name}; supported types "
                                 "are F32, F16, BF16 (quantized models are not supported yet: "
                                 "convert from the HF checkpoint with --outtype f16)")
        self.config = config_from_fields(self.fields, self.tensors, self.is_sparse, self.path)
        if validate:
            check_tensors(self.config, {n: self.raw(n).shape for n in self.tensors}, self.path)

    # --- metadata ---------------------------------------------------------------------------
    @property
    def is_sparse(self) -> bool:
        return self.magic == K.PWRI_MAGIC or any(n.endswith("fc1.weight") for n in self.tensors)

    def meta(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def error(self, msg: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {msg}")

    # --- tensors -----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor as a numpy memory-map view (bf16 shows as uint16); no copy."""
        if name not in self.tensors:
            raise self.error(f"missing tensor {name!r}")
        data = self.tensors[name].data
        return data.view(np.uint16) if data.dtype == np.uint8 else data  # gguf shows BF16 as bytes

    def dtype_of(self, name: str) -> str:
        return SUPPORTED_TYPES[self.tensors[name].tensor_type][0]

    def get(self, name: str, rows: Sequence[int] | np.ndarray | torch.Tensor | None = None,
            dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows ``rows`` (all when None) of tensor ``name`` as a torch tensor (a copy)."""
        arr = self.raw(name)
        arr = np.array(arr) if rows is None else arr[np.asarray(rows, dtype=np.int64)]  # a copy
        return _to_torch(arr, self.dtype_of(name), dtype, device)

    def layer(self, template: str, bid: int, rows: Any = None, dtype: torch.dtype | None = None,
              bias: bool = False, device: str | torch.device = "cpu") -> torch.Tensor:
        """A per-layer tensor by its template in ``gguf_keys`` (rows of it when given).

        Falls back to the layouts of other writers: ``ffn_down_t`` from a standard
        ``ffn_down`` [D, F], and q/k/v from a fused ``attn_qkv`` [(H + 2G) hd, D].
        """
        name = K.tensor(template, bid, bias)
        if name in self.tensors:
            return self.get(name, rows, dtype, device)
        if template == K.FFN_DOWN_T and not bias:
            down = self.raw(K.tensor(K.FFN_DOWN, bid))  # [D, F]
            cols = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
            arr = np.ascontiguousarray(down[:, cols].T)
            return _to_torch(arr, self.dtype_of(K.tensor(K.FFN_DOWN, bid)), dtype, device)
        if template in (K.ATTN_Q, K.ATTN_K, K.ATTN_V):
            fused = K.tensor(K.ATTN_QKV, bid, bias)
            if fused in self.tensors:
                base = self._qkv_rows(template)
                sel = base if rows is None else base[np.asarray(rows, dtype=np.int64)]
                return self.get(fused, sel, dtype, device)
        raise self.error(f"missing tensor {name!r}")

    def _qkv_rows(self, template: str) -> np.ndarray:
        c = self.config
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        start = {K.ATTN_Q: 0, K.ATTN_K: q, K.ATTN_V: q + kv}[template]
        return np.arange(start, start + (q if template == K.ATTN_Q else kv))

    def global_(self, name: str, dtype: torch.dtype | None = None, bias: bool = False) -> torch.Tensor:
        return self.get(K.global_tensor(name, bias), dtype=dtype)

    def output_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output head [V, D] (the token embedding when tied)."""
        name = K.OUTPUT if self.has(K.global_tensor(K.OUTPUT)) else K.TOKEN_EMBD
        return self.global_(name, dtype)


def _is_standard_down(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[1].isdigit() and K.tensor(K.FFN_DOWN, int(parts[1])) == name


def open_gguf(path: Path) -> GGUFReader:
    """Open any GGUF/PWRI file, turning the gguf package's errors into one clear message."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic not in (K.GGUF_MAGIC, K.PWRI_MAGIC):
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF' or b'PWRI')")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, TypeError, OverflowError, MemoryError) as exc:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF header ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ModelFileError(f"{path}: truncated: tensor {t.name!r} needs bytes up to {end}, "
                                 f"the file has {size}")
    return reader


def _to_torch(arr: np.ndarray, kind: str, dtype: torch.dtype | None, device: Any) -> torch.Tensor:
    t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if kind == "bf16" else torch.from_numpy(arr)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device) if str(device) != "cpu" else t


# ------------------------------------------------------------------------------------------------
# metadata <-> ModelConfig
# ------------------------------------------------------------------------------------------------
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
    dtype = SUPPORTED_TYPES.get(up.tensor_type, ("f32",))[0] if up is not None else "f32"
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


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced only when the writer reaches it (for models larger than RAM)."""

    shape: tuple[int, ...]
    dtype: str  # f32 | f16 | bf16 | i32
    make: Callable[[], np.ndarray | torch.Tensor]


TensorLike = np.ndarray | torch.Tensor | LazyTensor


def write_model(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, TensorLike],
                metadata: Mapping[str, Any] | None = None, sparse: bool | None = None,
                validate: bool = True, progress: bool = False) -> Path:
    """Write a model file. Matrices are stored at ``cfg.dtype``; 1-D tensors (norms, biases) at F32.

    ``sparse`` (default: the model has predictors) stamps upstream PowerInfer's ``PWRI`` magic.
    Tensors are written in the order given; lazy ones are produced one at a time.
    """
    path = Path(path)
    if validate:
        check_tensors(cfg, {n: tuple(_shape(t)) for n, t in tensors.items()}, path)
    fields = config_to_fields(cfg)
    fields.update(metadata or {})
    write_gguf(path, cfg.arch, fields, ((n, t, _storage_dtype(cfg, t)) for n, t in tensors.items()),
               progress=progress)
    if sparse if sparse is not None else cfg.has_predictors:
        with path.open("r+b") as fh:
            fh.write(K.PWRI_MAGIC)
    return path


def write_gguf(path: Path, arch: str, fields: Mapping[str, Any],
               tensors: Iterable[tuple[str, TensorLike, str]], progress: bool = False) -> None:
    """Write metadata and (name, tensor, storage dtype) triples with gguf's GGUFWriter."""
    items = list(tensors)
    w = GGUFWriter(path, arch)
    for k, v in fields.items():
        _add_field(w, k, v)
    for name, t, kind in items:
        shape = tuple(_shape(t))
        nbytes = int(np.prod(shape)) * (4 if kind in ("f32", "i32") else 2)
        np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32}[kind]
        w.add_tensor_info(name, shape, np.dtype(np_dtype), nbytes, raw_dtype=_GGML_OF[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _progress(progress, sum(int(np.prod(_shape(t))) for _, t, _ in items), f"writing {path.name}")
    for name, t, kind in items:
        arr = _to_numpy(t.make() if isinstance(t, LazyTensor) else t, kind)
        if tuple(arr.shape) != tuple(_shape(t)):
            raise ModelFileError(f"{path}: tensor {name!r} produced shape {list(arr.shape)}, "
                                 f"declared {list(_shape(t))}")
        w.write_tensor_data(arr)
        if bar is not None:
            bar.update(arr.size)
    w.close()
    if bar is not None:
        bar.close()


def _progress(enabled: bool, total: int, desc: str):  # noqa: ANN202
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="param", unit_scale=True)


def _shape(t: TensorLike) -> tuple[int, ...]:
    return tuple(t.shape)


def _storage_dtype(cfg: ModelConfig, t: TensorLike) -> str:
    if isinstance(t, LazyTensor):
        return t.dtype
    if t.dtype in (np.int32, torch.int32):
        return "i32"
    return cfg.dtype if len(t.shape) >= 2 else "f32"


def _to_numpy(t: np.ndarray | torch.Tensor, kind: str) -> np.ndarray:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    t = t.detach().cpu().contiguous()
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if kind == "i32":
        return t.to(torch.int32).numpy()
    return t.to(_TORCH_OF[kind]).numpy()


def _add_field(w: GGUFWriter, key: str, v: Any) -> None:
    if key == K.ARCH:
        return  # GGUFWriter writes it from its arch argument
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, (int, np.integer)):
        v = int(v)
        w.add_uint32(key, v) if 0 <= v < 2**32 else w.add_int64(key, v)
    elif isinstance(v, (float, np.floating)):
        w.add_float32(key, float(v))
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, (list, tuple, np.ndarray)):
        w.add_array(key, list(v.tolist() if isinstance(v, np.ndarray) else v))
    else:
        raise TypeError(f"metadata {key!r}: cannot store a {type(v).__name__} in GGUF")
