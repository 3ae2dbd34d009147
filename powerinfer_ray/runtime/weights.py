"""What the primary executor holds, loaded from a WeightSource for a plan: the embeddings, norms,
output head, predictors, and its shard of each layer's neurons and heads (with their KV cache).

Both runners of the layer schedule (``schedule.py``) read these, and nothing else of the model.
Dimension legend: N tokens of a step, D hidden, V vocab, r predictor width.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as Fn

from ..kernels.predictor import predictor_logits
from ..model import gguf_keys as K
from ..model.reference import layer_norm, rms_norm
from ..model.source import WeightSource, layer_rows
from .layers import Policy
from .plan import Plan
from .shard import AttnShard, FFNShard, load_attn_shard, load_ffn_shard

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
Norm = tuple[torch.Tensor, torch.Tensor | None]  # weight [D], bias [D] or None


@dataclass
class LayerWeights:
    """The per-layer tensors only the primary holds."""

    norm_attn: Norm
    norm_ffn: Norm | None  # None: falcon's single norm
    fc1: torch.Tensor | None  # [r, D]
    fc2: torch.Tensor | None  # [n_gpu + n_cpu, r]: the primary's neurons' rows, then the CPU's
    ffn: FFNShard
    attn: AttnShard
    # the layer-wide biases, added once where the partial outputs merge: after the attention
    # (sequential layers) and after the FFN (with parallel attention: both biases there)
    attn_bias: torch.Tensor | None
    ffn_bias: torch.Tensor | None
    weight_bytes: int  # the attention's and predictor's bytes: read by every step


class PrimaryWeights:
    """The primary's tensors on its device (see the module docstring); ``slots`` sequences plus a
    scratch slot for padded decode rows in the KV caches."""

    def __init__(self, src: WeightSource, plan: Plan, policy: Policy, device: torch.device,
                 dtype: torch.dtype, slots: int, n_ctx: int) -> None:
        self.src, self.cfg, self.plan, self.policy = src, src.config, plan, policy
        self.device, self.dtype, self.slots, self.n_ctx = device, dtype, slots, n_ctx
        cfg, dev, dt = self.cfg, device, dtype
        # host seconds of each kind of tensor (H2D copies from pageable memory are synchronous)
        self.phases = {"globals": 0.0, "predictors": 0.0, "attention": 0.0, "ffn": 0.0}
        t0 = time.perf_counter()
        self.embd = src.global_(K.TOKEN_EMBD, dt).to(dev)  # [V, D]
        self.pos_embd = src.global_(K.POS_EMBD, dt).to(dev) if cfg.arch == "opt" else None
        self.out_norm = self._norm_pair(K.OUTPUT_NORM, None)
        self.out_w = self.embd if cfg.tied_output else src.output_weight(dt).to(dev)  # [V, D]
        self.phases["globals"] += time.perf_counter() - t0
        self.layers = [self._layer(l) for l in range(cfg.n_layer)]
        # what the fixed-shape decode step reads: rotary rows of every position, the predictor's
        # GPU rows (they come first in fc2), every GPU row (policy 'dense')
        self.rope_cos = self.rope_sin = None
        if cfg.rope_style is not None:
            from ..kernels.attention import rope_table

            self.rope_cos, self.rope_sin = rope_table(n_ctx, cfg.rot_dims, cfg.rope_theta, dev)
        self.gpu_first = [torch.arange(lw.ffn.n + len(lp.cpu_neurons), device=dev) < lw.ffn.n
                          for lw, lp in zip(self.layers, plan.layers)]
        self.all_rows = [torch.arange(lw.ffn.n, dtype=torch.int32, device=dev) for lw in self.layers]

    # --- loading ---------------------------------------------------------------------------------
    def _vec(self, tmpl: str, l: int | None, bias: bool = False) -> torch.Tensor | None:
        name = K.global_tensor(tmpl, bias) if l is None else K.tensor(tmpl, l, bias)
        if not self.src.has(name):
            return None
        if l is None:
            return self.src.global_(tmpl, torch.float32, bias).to(self.device)
        return self.src.layer(tmpl, l, dtype=torch.float32, bias=bias, device=self.device)

    def _norm_pair(self, tmpl: str, l: int | None) -> Norm:
        return self._vec(tmpl, l), self._vec(tmpl, l, bias=True)

    def _layer(self, l: int) -> LayerWeights:
        cfg, lp, dev, dt = self.cfg, self.plan[l], self.device, self.dtype
        norm_ffn_t = K.ATTN_NORM_2 if cfg.two_norms else (None if cfg.parallel_attn else K.FFN_NORM)
        fc1 = fc2 = None
        if self.policy.name == "predictor":
            t0 = time.perf_counter()
            fc1 = layer_rows(self.src, K.FC1, l, dtype=dt, device=dev)
            rows = np.concatenate([lp.gpu_neurons, lp.cpu_neurons])
            fc2 = layer_rows(self.src, K.FC2, l, rows=rows, dtype=dt, device=dev)
            self.phases["predictors"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        attn = load_attn_shard(self.src, l, lp.gpu_groups, dt, dev, self.slots + 1, self.n_ctx)
        self.phases["attention"] += time.perf_counter() - t0
        attn_out_b, down_b = self._vec(K.ATTN_OUT, l, bias=True), self._vec(K.FFN_DOWN_T, l, bias=True)
        if cfg.parallel_attn:
            attn_bias, ffn_bias = None, _add(attn_out_b, down_b)
        else:
            attn_bias, ffn_bias = attn_out_b, down_b
        nbytes = attn.weight_bytes + sum(t.numel() * t.element_size() for t in (fc1, fc2) if t is not None)
        t0 = time.perf_counter()
        ffn = load_ffn_shard(self.src, l, lp.gpu_neurons, dt, dev)
        self.phases["ffn"] += time.perf_counter() - t0
        return LayerWeights(self._norm_pair(K.ATTN_NORM, l), self._norm_pair(norm_ffn_t, l) if norm_ffn_t else None,
                            fc1, fc2, ffn, attn, attn_bias, ffn_bias, nbytes)

    # --- what the layer schedule computes with ---------------------------------------------------
    def norm(self, x: torch.Tensor, pair: Norm) -> torch.Tensor:
        """The norm of the fp32 residual x [N, D], in the compute dtype (fused kernels on CUDA)."""
        if self.cfg.norm == "rms":
            y = Fn.rms_norm(x, (x.shape[-1],), pair[0], self.cfg.norm_eps) if x.is_cuda \
                else rms_norm(x, pair[0], self.cfg.norm_eps)
        else:
            y = layer_norm(x, pair[0], pair[1], self.cfg.norm_eps)
        return y.to(self.dtype)

    def predict(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        """The predictor's logits [N, n_gpu + n_cpu] of layer l (the primary's neurons first)."""
        lw = self.layers[l]
        return predictor_logits(pred_in.to(self.dtype), lw.fc1, lw.fc2)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] (fp32) of the last residual rows h [B, D]."""
        return (self.norm(h, self.out_norm) @ self.out_w.T).float()

    # --- accounting ------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes held (weights + KV cache), as counted against a VRAM budget."""
        ts = [self.embd, self.out_w if self.out_w is not self.embd else None, self.pos_embd]
        total = sum(t.numel() * t.element_size() for t in ts if t is not None)
        return total + sum(lw.ffn.nbytes + lw.weight_bytes + lw.attn.cache_bytes for lw in self.layers)

    def read_bytes_per_step(self) -> int:
        """Weight bytes every step reads besides the active FFN rows: attention of its heads,
        predictors, output head (the roofline numerator of the dense parts)."""
        return self.out_w.numel() * self.out_w.element_size() + sum(lw.weight_bytes for lw in self.layers)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else (a if b is None else a + b)
