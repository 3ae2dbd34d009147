"""ModelConfig: what a model is, read once from GGUF metadata, with derived sizes computed once.

Dimension legend used across the project:
  V n_vocab   D n_embd   L n_layer   H n_head   G n_head_kv (KV-head groups)   hd head_dim
  F n_ff (FFN neurons)   r predictor width   T tokens   S context
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .qtypes import BLOCK_BYTES, QK, QTYPES, row_bytes

ARCHS = ("llama", "qwen2", "opt", "falcon")
FFN_ACTS = ("relu", "reglu", "drelu", "swiglu")
THRESHOLD_ON = ("gate", "h")  # what a SwiGLU threshold compares: |SiLU(gate_j)| or |h_j|
DTYPES = ("f32", "f16", "bf16")
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


class ConfigError(ValueError):
    """Model metadata that contradicts itself or names something unsupported."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # llama | qwen2 | opt | falcon
    ffn_act: str  # relu | reglu | drelu | swiglu
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_rot: int = 0  # rotary dims; 0 -> head_dim (set in __post_init__; 0 without rope)
    parallel_attn: bool = False  # falcon: x + attn(ln(x)) + ffn(ln'(x))
    two_norms: bool = False  # falcon new decoder architecture: separate ln_attn / ln_mlp
    bias: bool = False  # q/k/v/o and up/down biases (opt)
    qkv_bias: bool = False  # q/k/v biases only (qwen2)
    tied_output: bool = False  # output head is token_embd
    sparse_threshold: float | None = None  # neuron skipped iff predictor logit < threshold
    predictor_ranks: tuple[int, ...] = ()  # per-layer predictor width r (empty: no predictors)
    # SwiGLU activation sparsity: per layer l, neuron j is active iff its criterion exceeds
    # ffn_thresholds[l] (empty: dense); the criterion is |SiLU(gate_j)| or |h_j| (ffn_threshold_on)
    ffn_thresholds: tuple[float, ...] = ()
    ffn_threshold_on: str = "gate"
    dtype: str = "f32"  # storage dtype of the big matrices
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        def bad(what: str, got: Any, expected: str) -> ConfigError:
            return ConfigError(f"model config: {what} is {got!r}, expected {expected}")

        if self.arch not in ARCHS:
            raise bad("architecture", self.arch, f"one of {ARCHS}")
        if self.ffn_act not in FFN_ACTS:
            raise bad("ffn_act", self.ffn_act, f"one of {FFN_ACTS}")
        if self.dtype not in DTYPES + QTYPES:
            raise bad("dtype", self.dtype, f"one of {DTYPES + QTYPES}")
        if self.dtype in QTYPES and self.n_embd % QK:
            raise bad("n_embd", self.n_embd, f"a multiple of {QK} (the {self.dtype} block) for dtype {self.dtype}")
        for name in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_ctx"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, getattr(self, name), "a positive integer")
        if self.n_embd % self.n_head:
            raise bad("n_embd", self.n_embd, f"a multiple of n_head={self.n_head}")
        if self.n_head % self.n_head_kv:
            raise bad("n_head_kv", self.n_head_kv, f"a divisor of n_head={self.n_head}")
        if self.predictor_ranks and len(self.predictor_ranks) != self.n_layer:
            raise bad("predictor_ranks", len(self.predictor_ranks), f"{self.n_layer} entries")
        self._check_thresholds(bad)
        if self.rope_style is None:
            object.__setattr__(self, "n_rot", 0)
        elif self.n_rot == 0:
            object.__setattr__(self, "n_rot", self.head_dim)
        elif not (0 < self.n_rot <= self.head_dim and self.n_rot % 2 == 0):
            raise bad("n_rot", self.n_rot, f"an even number of rotary dims <= head_dim={self.head_dim}")

    def _check_thresholds(self, bad) -> None:  # noqa: ANN001
        object.__setattr__(self, "ffn_thresholds", tuple(float(t) for t in self.ffn_thresholds))
        if not self.ffn_thresholds:
            return
        if self.ffn_act != "swiglu":
            raise bad("ffn_thresholds", "present", f"none for ffn_act={self.ffn_act} (its zeros are "
                      "already sparse; thresholds are for SwiGLU)")
        if len(self.ffn_thresholds) != self.n_layer:
            raise bad("ffn_thresholds", f"{len(self.ffn_thresholds)} values",
                      f"one per layer: n_layer={self.n_layer}")
        if any(not t >= 0.0 for t in self.ffn_thresholds):  # rejects NaN too
            raise bad("ffn_thresholds", list(self.ffn_thresholds), "values >= 0")
        if self.ffn_threshold_on not in THRESHOLD_ON:
            raise bad("ffn_threshold_on", self.ffn_threshold_on, f"one of {THRESHOLD_ON}")

    # --- derived sizes ------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_gqa(self) -> int:
        """Query heads per KV-head group."""
        return self.n_head // self.n_head_kv

    @property
    def rot_dims(self) -> int:
        return self.n_rot

    @property
    def gated(self) -> bool:
        """True when the FFN has a gate matrix (every variant but plain ReLU)."""
        return self.ffn_act != "relu"

    @property
    def rope_style(self) -> str | None:
        """'norm' = GGML mode 0 (adjacent pairs; llama GGUF stores Q/K permuted for it),
        'neox' = rotate halves (falcon, qwen2), None = learned absolute positions (opt)."""
        return {"llama": "norm", "qwen2": "neox", "falcon": "neox", "opt": None}[self.arch]

    @property
    def norm(self) -> str:
        return "rms" if self.arch in ("llama", "qwen2") else "layer"

    @property
    def has_qkv_bias(self) -> bool:
        """q/k/v carry biases (opt: with all others; qwen2: alone)."""
        return self.bias or self.qkv_bias

    @property
    def thresholded(self) -> bool:
        """SwiGLU with per-layer activation thresholds (``sparsify``)."""
        return bool(self.ffn_thresholds)

    @property
    def pos_offset(self) -> int:
        """OPT's learned position table starts at index 2."""
        return 2 if self.arch == "opt" else 0

    @property
    def has_predictors(self) -> bool:
        return bool(self.predictor_ranks)

    @property
    def dtype_bytes(self) -> float:
        """Bytes per weight of the big matrices (block types: the block's bytes / 32)."""
        return DTYPE_BYTES.get(self.dtype) or BLOCK_BYTES[self.dtype] / QK

    @property
    def float_dtype(self) -> str:
        """The float type of what a block-quantized model keeps in float (its own dtype otherwise)."""
        return "f16" if self.dtype in QTYPES else self.dtype

    @property
    def neuron_bytes(self) -> int:
        """Bytes of one FFN neuron: its rows of up, gate (if any) and down_t."""
        return (3 if self.gated else 2) * row_bytes(self.dtype, self.n_embd)

    @property
    def attn_bytes(self) -> int:
        """Bytes of one layer's q/k/v/o matrices."""
        hd = self.head_dim
        return (2 * self.n_head * hd + 2 * self.n_head_kv * hd) * row_bytes(self.dtype, self.n_embd)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token per layer (fp16 cache)."""
        return 2 * self.n_head_kv * self.head_dim * 2

    def with_(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)
