"""Dense reference forward in plain torch: the oracle of every test and the dense baseline.

One sequence at a time, prefill and cached decode, for llama (ReGLU / dReLU / ReLU / SwiGLU,
GQA, RoPE), qwen2 (llama with q/k/v biases and NeoX RoPE), opt (ReLU, biases, learned positions,
LayerNorm) and falcon (ReLU, parallel attention, MQA/GQA, LayerNorm). Written for clarity, not
speed: the runtime's sparse operators are checked against it.

A SwiGLU model with per-layer thresholds (``ModelConfig.ffn_thresholds``) runs *thresholded* by
default: h_j is zeroed where its criterion (|SiLU(gate_j)| or |h_j|) is not above t_l, and every
hook sees the thresholded h, so profiling, predictor training and oracle masks treat it as they
treat ReLU's zeros. ``thresholded=False`` runs it dense.

Hooks let offline tools look inside the FFN without a second implementation:
``FFNHooks.mask(l, pred_in)`` returns a [T, F] bool mask of neurons to keep (None: keep all),
``FFNHooks.observe(l, pred_in, h)`` sees the predictor input and the FFN activations.
The predictor input is the residual stream before the FFN norm (llama, opt) or the layer input
(falcon, whose attention and FFN read the same input), as upstream PowerInfer feeds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as Fn

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_file import ModelFile


class FFNHooks(Protocol):
    def mask(self, layer: int, pred_in: torch.Tensor) -> torch.Tensor | None: ...  # [T, F] bool

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None: ...  # h [T, F]


# ------------------------------------------------------------------------------------------------
# building blocks (shared by the reference model and, where useful, the runtime)
# ------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [.., D] -> [.., D], computed in fp32 (or fp64 when x is fp64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.to(y.dtype)).to(x.dtype)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    y = Fn.layer_norm(xf, (x.shape[-1],), w.to(xf.dtype), b.to(xf.dtype), eps)
    return y.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, n_rot: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles pos * theta^(-2i/n_rot) for i < n_rot/2: cos, sin [T, n_rot/2]."""
    inv = theta ** (-torch.arange(0, n_rot, 2, dtype=torch.float64, device=pos.device) / n_rot)  # [n_rot/2]
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, n_rot/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, n_rot: int, theta: float, style: str) -> torch.Tensor:
    """Rotate x [T, H, hd] by positions pos [T]. style 'norm' rotates adjacent pairs
    (x[2i], x[2i+1]) (GGML mode 0), 'neox' rotates (x[i], x[i + n_rot/2]). Dims >= n_rot pass."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_cos_sin(pos, n_rot, theta, cdt)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, n_rot/2]
    xr, rest = x[..., :n_rot].to(cdt), x[..., n_rot:]
    if style == "norm":
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    elif style == "neox":
        a, b = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    else:
        raise ValueError(f"rope style {style!r}: expected 'norm' or 'neox'")
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def threshold_criterion(on: str, gate: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """What a SwiGLU threshold compares, [T, F]: |SiLU(gate)| (on='gate') or |h| (on='h')."""
    if on == "gate":
        return Fn.silu(gate).abs()
    if on == "h":
        return h.abs()
    raise ValueError(f"threshold criterion {on!r}: expected 'gate' or 'h'")


def ffn_activation(act: str, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The FFN's per-neuron activation h [T, F] from up (and gate) projections [T, F]."""
    if act == "relu":
        return torch.relu(up)
    assert gate is not None, f"ffn_act={act} needs a gate projection"
    if act == "reglu":
        return torch.relu(gate) * up
    if act == "drelu":
        return torch.relu(gate) * torch.relu(up)
    if act == "swiglu":
        return Fn.silu(gate) * up
    raise ValueError(f"ffn_act {act!r}: expected relu, reglu, drelu or swiglu")


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Per-layer K and V of one sequence: k[l], v[l] are [S, G, hd]."""

    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.k[0].shape[0]) if 0 in self.k else 0


class ReferenceModel:
    """The dense model, holding every weight as a torch tensor (keyed by GGUF tensor name)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 thresholded: bool = True) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = {n: t.to(device=self.device, dtype=dtype) for n, t in weights.items()}
        self.w.setdefault(K.global_tensor(K.OUTPUT), self.w[K.global_tensor(K.TOKEN_EMBD)])  # tied head
        self.thresholds: tuple[float, ...] | None = None
        self.threshold_on = cfg.ffn_threshold_on
        if thresholded and cfg.thresholded:
            self.set_thresholds(cfg.ffn_thresholds, cfg.ffn_threshold_on)

    def set_thresholds(self, thresholds: Sequence[float] | None, on: str = "gate") -> None:
        """Run thresholded with per-layer ``thresholds`` on criterion ``on`` (None: dense)."""
        if thresholds is None:
            self.thresholds = None
            return
        if self.cfg.ffn_act != "swiglu" or len(thresholds) != self.cfg.n_layer:
            raise ValueError(f"thresholds: {len(thresholds)} values for a {self.cfg.ffn_act} model of "
                             f"{self.cfg.n_layer} layers; expected one per layer of a SwiGLU model")
        threshold_criterion(on, torch.zeros(1), torch.zeros(1))  # validates ``on``
        self.thresholds, self.threshold_on = tuple(float(t) for t in thresholds), on

    @classmethod
    def from_file(cls, path: str | Path | ModelFile, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", thresholded: bool = True) -> "ReferenceModel":
        mf = path if isinstance(path, ModelFile) else ModelFile(path)
        cfg = mf.config
        weights: dict[str, torch.Tensor] = {}
        for l in range(cfg.n_layer):  # through ModelFile.layer so that alternative layouts load
            for tmpl in K.LAYER_TENSORS:
                for bias in (False, True):
                    try:
                        weights[K.tensor(tmpl, l, bias)] = mf.layer(tmpl, l, bias=bias)
                    except ValueError:
                        pass
        for name in mf.tensors:
            if not name.startswith("blk."):
                weights[name] = mf.get(name)
        return cls(cfg, weights, dtype, device, thresholded)

    def new_cache(self) -> KVCache:
        return KVCache()

    # --- pieces ---------------------------------------------------------------------------
    def _t(self, tmpl: str, l: int, bias: bool = False) -> torch.Tensor | None:
        return self.w.get(K.tensor(tmpl, l, bias))

    def _norm(self, x: torch.Tensor, tmpl: str, l: int | None) -> torch.Tensor:
        if l is None:
            w, b = self.w[K.global_tensor(tmpl)], self.w.get(K.global_tensor(tmpl, True))
        else:
            w, b = self._t(tmpl, l), self._t(tmpl, l, True)
        if self.cfg.norm == "rms":
            return rms_norm(x, w, self.cfg.norm_eps)
        return layer_norm(x, w, b, self.cfg.norm_eps)

    def _linear(self, x: torch.Tensor, tmpl: str, l: int) -> torch.Tensor:
        y = x @ self._t(tmpl, l).T
        b = self._t(tmpl, l, True)
        return y if b is None else y + b

    def attention(self, l: int, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x [T, D] normed -> [T, D]; appends this step's K/V to the cache."""
        c, T = self.cfg, x.shape[0]
        q = self._linear(x, K.ATTN_Q, l).view(T, c.n_head, c.head_dim)  # [T, H, hd]
        k = self._linear(x, K.ATTN_K, l).view(T, c.n_head_kv, c.head_dim)  # [T, G, hd]
        v = self._linear(x, K.ATTN_V, l).view(T, c.n_head_kv, c.head_dim)  # [T, G, hd]
        if c.rope_style is not None:
            q = apply_rope(q, pos, c.rot_dims, c.rope_theta, c.rope_style)
            k = apply_rope(k, pos, c.rot_dims, c.rope_theta, c.rope_style)
        if l in cache.k:
            k, v = torch.cat((cache.k[l], k)), torch.cat((cache.v[l], v))
        cache.k[l], cache.v[l] = k, v
        ks = cache.k[l].repeat_interleave(c.n_gqa, dim=1)  # [S, H, hd]
        vs = cache.v[l].repeat_interleave(c.n_gqa, dim=1)  # [S, H, hd]
        S = ks.shape[0]
        scores = torch.einsum("thd,shd->hts", q, ks) / math.sqrt(c.head_dim)  # [H, T, S]
        allowed = torch.arange(S, device=x.device)[None, :] <= pos[:, None]  # [T, S]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), vs).reshape(T, -1)  # [T, H*hd]
        return self._linear(out, K.ATTN_OUT, l)

    def ffn_pre(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """x [T, D] normed -> up [T, F], gate [T, F] (None without one), dense h [T, F]."""
        up = self._linear(x, K.FFN_UP, l)  # [T, F]
        gate = x @ self._t(K.FFN_GATE, l).T if self.cfg.gated else None  # [T, F]
        return up, gate, ffn_activation(self.cfg.ffn_act, up, gate)

    def ffn_input(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        """The normed FFN input [T, D] of layer l from its predictor input [T, D]."""
        c = self.cfg
        if not c.parallel_attn:
            return self._norm(pred_in, K.FFN_NORM, l)
        return self._norm(pred_in, K.ATTN_NORM_2 if c.two_norms else K.ATTN_NORM, l)

    def criterion(self, l: int, pred_in: torch.Tensor, on: str = "gate") -> torch.Tensor:
        """The dense threshold criterion [T, F] of layer l (for calibration), from the predictor
        input [T, D] that hooks see."""
        _, gate, h = self.ffn_pre(l, self.ffn_input(l, pred_in))
        assert gate is not None, f"ffn_act={self.cfg.ffn_act}: thresholds need a gate"
        return threshold_criterion(on, gate, h)

    def ffn(self, l: int, x: torch.Tensor, mask: torch.Tensor | None = None,
            observe: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """x [T, D] normed -> [T, D]; ``mask`` [T, F] keeps only the listed neurons."""
        _, gate, h = self.ffn_pre(l, x)  # h [T, F]
        if self.thresholds is not None:
            keep = threshold_criterion(self.threshold_on, gate, h) > self.thresholds[l]  # [T, F]
            h = torch.where(keep, h, torch.zeros((), dtype=h.dtype, device=h.device))
        if observe is not None:
            observe(h)
        if mask is not None:
            h = h * mask.to(h.dtype)
        y = h @ self._t(K.FFN_DOWN_T, l)  # [T, D]
        b = self._t(K.FFN_DOWN_T, l, True)
        return y if b is None else y + b

    def block(self, l: int, x: torch.Tensor, pos: torch.Tensor, cache: KVCache,
              hooks: FFNHooks | None = None) -> torch.Tensor:
        a = self.attention(l, self._norm(x, K.ATTN_NORM, l), pos, cache)
        if not self.cfg.parallel_attn:
            x = x + a
        pred_in = x  # the layer input (parallel attention) or the residual after attention
        mask = hooks.mask(l, pred_in) if hooks is not None else None
        observe = (lambda h: hooks.observe(l, pred_in, h)) if hooks is not None else None
        f = self.ffn(l, self.ffn_input(l, pred_in), mask, observe)
        return x + a + f if self.cfg.parallel_attn else x + f

    def embed(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.w[K.global_tensor(K.TOKEN_EMBD)][tokens]  # [T, D]
        if self.cfg.arch == "opt":
            x = x + self.w[K.global_tensor(K.POS_EMBD)][pos + self.cfg.pos_offset]
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, K.OUTPUT_NORM, None) @ self.w[K.global_tensor(K.OUTPUT)].T  # [T, V]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor | list[int], cache: KVCache,
                hooks: FFNHooks | None = None) -> torch.Tensor:
        """Run tokens [T] after what the cache holds; returns logits [T, V] (fp32 or fp64)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        start = cache.length
        if start + tokens.numel() > self.cfg.n_ctx:
            raise ValueError(f"sequence of {start + tokens.numel()} tokens exceeds the context "
                             f"length n_ctx={self.cfg.n_ctx}")
        pos = torch.arange(start, start + tokens.numel(), device=self.device)
        x = self.embed(tokens, pos)
        for l in range(self.cfg.n_layer):
            x = self.block(l, x, pos, cache, hooks)
        logits = self.head(x)
        return logits if logits.dtype == torch.float64 else logits.float()

    @torch.no_grad()
    def generate_greedy(self, prompt: list[int], n: int, hooks: FFNHooks | None = None) -> list[int]:
        cache = self.new_cache()
        logits = self.forward(prompt, cache, hooks)
        out: list[int] = []
        for _ in range(n):
            tok = int(logits[-1].argmax())
            out.append(tok)
            logits = self.forward([tok], cache, hooks)
        return out
