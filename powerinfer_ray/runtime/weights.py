"""What the primary executor holds, loaded from a WeightSource for a plan: the embeddings, norms,
output head, predictors, and its shard of each layer's neurons and heads (with their KV cache).

Both runners of the layer schedule (``schedule.py``) read these, and nothing else of the model.
Matrices the source stores as Q8_0 / Q4_0 blocks stay blocks (with their qtype beside them) and
go to the quantized kernels; the token embedding too, its rows dequantized as a step gathers them
(3.6x fewer bytes than f16 at Q4_0, for a gather of a few rows per step). Everything else is in
the float ``dtype``; norms and biases in f32.
Dimension legend: N tokens of a step, D hidden, V vocab, r predictor width.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.linear import GEMV_MAX_T, linear
from ..kernels.norm import add_rms_norm, rms_norm_cast
from ..kernels.predictor import predictor_logits_of
from ..kernels.quant import dequantize, repack_, repackable
from ..model import gguf_keys as K
from ..model.costs import embedding_apart, predictor_kind
from ..model.qtypes import QTYPES
from ..model.quants import quantize
from ..model.reference import layer_norm
from ..model.source import WeightSource, layer_rows
from ..model.staging import pinned_staging
from .channel import device_view
from .layers import Policy, add_partials
from .plan import Plan, Swap
from .shard import AttnShard, FFNShard, load_attn_shard, load_ffn_shard, replace_neurons

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
Norm = tuple[torch.Tensor, torch.Tensor | None]  # weight [D], bias [D] or None


@dataclass
class LayerWeights:
    """The per-layer tensors only the primary holds."""

    norm_attn: Norm
    norm_ffn: Norm | None  # None: falcon's single norm
    fc1: torch.Tensor | None  # [r, D] (quantized: blocks [r, D / 32 * block bytes])
    fc2: torch.Tensor | None  # [n_gpu + n_cpu, r]: the primary's neurons' rows, then the CPU's
    fc_qtypes: tuple[str | None, str | None]  # fc1's and fc2's (None: float)
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
        cfg, dev = self.cfg, device
        # host seconds of each kind of tensor (a file's rows go through pinned buffers: a copy waits
        # only for the one before the last)
        self.phases = {"globals": 0.0, "predictors": 0.0, "attention": 0.0, "ffn": 0.0}
        with pinned_staging(dev):
            t0 = time.perf_counter()
            self.embd, self.embd_q = self._embedding()  # [V, D]
            self.pos_embd, self.pos_q = self._global(K.POS_EMBD) if cfg.arch == "opt" else (None, None)
            self.out_norm = self._norm_pair(K.OUTPUT_NORM, None)
            self.out_w, self.out_q = (self._gemv_form(*self._global(K.OUTPUT)) if embedding_apart(src)
                                      else (self.embd, self.embd_q))
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
    def _global(self, name: str) -> tuple[torch.Tensor, str | None]:
        """A model-level matrix on the device: its blocks and qtype, or floats in dtype and None
        (a Q6_K output head comes dequantized)."""
        q = self.src.qtype(name)
        if q is not None:
            return self.src.global_blocks(name, device=self.device).blocks, q
        return self.src.global_(name, self.dtype).to(self.device), None

    def _embedding(self) -> tuple[torch.Tensor, str | None]:
        """The token embedding as ``_global``, or with ``plan.embd_on_host`` in page-locked host
        memory, which a CUDA primary reads through a device view: a step gathers its rows over PCIe
        (a few KB), and the budget's bytes hold hot neurons."""
        if not self.plan.embd_on_host:
            return self._global(K.TOKEN_EMBD)
        q = self.src.qtype(K.TOKEN_EMBD)
        w = self.src.global_blocks(K.TOKEN_EMBD).blocks if q is not None else self.src.global_(K.TOKEN_EMBD, self.dtype)
        if self.device.type != "cuda":
            return w, q
        self.embd_host = torch.empty_like(w, pin_memory=True).copy_(w)  # the device view's bytes
        return device_view(self.embd_host), q

    def _matrix(self, tmpl: str, l: int, rows: np.ndarray | None = None) -> tuple[torch.Tensor, str | None]:
        """Rows of a layer's matrix on the device, as ``_global``."""
        q = self.src.qtype(tmpl, l)
        if q is not None:
            return self.src.layer_blocks(tmpl, l, rows=rows, device=self.device).blocks, q
        return layer_rows(self.src, tmpl, l, rows=rows, dtype=self.dtype, device=self.device), None

    def _predictor(self, tmpl: str, l: int, rows: np.ndarray | None = None) -> tuple[torch.Tensor, str | None]:
        """A predictor matrix as ``_matrix`` holds it, or as the plan's ``predictor_qtype`` blocks
        when the source stores it in float (``model.costs.predictor_kind`` says which)."""
        kind = predictor_kind(self.src, tmpl, l, self.plan.predictor_qtype)
        if kind not in QTYPES or self.src.qtype(tmpl, l) is not None:
            return self._matrix(tmpl, l, rows)
        w = layer_rows(self.src, tmpl, l, rows=rows, dtype=torch.float32, device=self.device)
        return quantize(w, kind), kind

    def _gemv_form(self, w: torch.Tensor, q: str | None) -> tuple[torch.Tensor, str | None]:
        """A matrix only the dense GEMV reads (``linear``), as it reads it fastest: Q4_0 rows on
        CUDA repacked in place (``kernels.quant.repack``), anything else as it is."""
        return (w, repack_(w, q)) if self._repacks(w, q) else (w, q)

    def _repacks(self, w: torch.Tensor, q: str | None) -> bool:
        return self.device.type == "cuda" and repackable(w, q)

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
        fc1 = fc2 = q1 = q2 = None
        if self.policy.name == "predictor":
            t0 = time.perf_counter()
            fc1, q1 = self._gemv_form(*self._predictor(K.FC1, l))
            fc2, q2 = self._gemv_form(*self._predictor(K.FC2, l, np.concatenate([lp.gpu_neurons, lp.cpu_neurons])))
            self.phases["predictors"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        attn = load_attn_shard(self.src, l, lp.gpu_groups, dt, dev, self.slots + 1, self.n_ctx)
        if attn.n_groups and all(self._repacks(w, attn.qtype) for w in (attn.wqkv, attn.wo_t.T)):
            repack_(attn.wqkv, attn.qtype)  # the projections' rows (wq, wk, wv are views of them)
            attn.qtype = repack_(attn.wo_t.T, attn.qtype)
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
                            fc1, fc2, (q1, q2), ffn, attn, attn_bias, ffn_bias, nbytes)

    def swap(self, s: Swap) -> None:
        """Re-placement (``runtime.replacement``), between steps: the neurons ``s.to_gpu`` take the
        shard's rows ``s.gpu_rows`` (their rows copied in from the source over the ones leaving),
        and the predictor's rows of both sides trade places in fc2 (the primary's neurons first,
        then the CPU's: the split's masks follow). Every tensor keeps its address and size."""
        lw, ng = self.layers[s.l], self.layers[s.l].ffn.n
        replace_neurons(self.src, s.l, lw.ffn, s.gpu_rows, s.to_gpu)
        if lw.fc2 is not None:
            g = torch.from_numpy(s.gpu_rows).to(self.device)
            c = torch.from_numpy(ng + s.cpu_rows).to(self.device)
            gpu_side = lw.fc2[g]  # [m, r] copies
            lw.fc2[g] = lw.fc2[c]
            lw.fc2[c] = gpu_side
        self.plan = self.plan.swap(s)

    # --- what the layer schedule computes with ---------------------------------------------------
    def norm(self, x: torch.Tensor, pair: Norm) -> torch.Tensor:
        """The norm of the fp32 residual x [N, D], in the compute dtype (fused kernels on CUDA)."""
        if self.cfg.norm == "rms":
            return rms_norm_cast(x, pair[0], self.cfg.norm_eps, self.dtype)
        return layer_norm(x, pair[0], pair[1], self.cfg.norm_eps).to(self.dtype)

    def add_norm(self, h: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None,
                 pair: Norm | None) -> torch.Tensor | None:
        """h += each part [N, D] and bias (in place, in that order), then ``norm`` of h with
        ``pair`` (None: no norm, returns None; RMS: one kernel on CUDA, the adds included)."""
        if pair is not None and self.cfg.norm == "rms":
            return add_rms_norm(h, parts, bias, pair[0], self.cfg.norm_eps, self.dtype)
        if parts or bias is not None:
            add_partials(h, parts + [bias])
        return None if pair is None else self.norm(h, pair)

    def embed(self, tok: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream's start [N, D] (fp32) for tokens tok [N] (at positions pos [N]
        with learned positions: OPT)."""
        h = _rows(self.embd, self.embd_q, tok)
        if self.pos_embd is not None:
            h = h + _rows(self.pos_embd, self.pos_q, pos + self.cfg.pos_offset)
        return h

    def predict(self, l: int, pred_in: torch.Tensor) -> torch.Tensor:
        """The predictor's logits [N, n_gpu + n_cpu] of layer l (the primary's neurons first): in the
        compute dtype, or fp32 from quantized predictors. These read a decode step's fp32 input as
        it is (two GEMVs on CUDA, fc1's ReLU in its kernel); a prompt chunk's go through the GEMMs
        of its rows dequantized in the compute dtype (``linear``: more than GEMV_MAX_T tokens)."""
        lw = self.layers[l]
        q1, q2 = lw.fc_qtypes
        if q1 is None and q2 is None:
            return predictor_logits_of(pred_in, lw.fc1, lw.fc2, self.dtype)
        cast = (lambda t: t) if pred_in.shape[0] <= GEMV_MAX_T else (lambda t: t.to(self.dtype))  # noqa: E731
        z = linear(cast(pred_in), lw.fc1, qtype=q1, relu=True)  # [N, r] fp32
        return linear(cast(z), lw.fc2, qtype=q2)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] (fp32) of the last residual rows h [B, D]."""
        x = self.norm(h, self.out_norm)
        return (x @ self.out_w.T).float() if self.out_q is None else linear(x, self.out_w, qtype=self.out_q)

    # --- accounting ------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes held (weights + KV cache), as counted against a VRAM budget (an embedding in host
        memory is not)."""
        ts = [None if self.plan.embd_on_host else self.embd, self.out_w if self.out_w is not self.embd else None,
              self.pos_embd]
        total = sum(t.numel() * t.element_size() for t in ts if t is not None)
        return total + sum(lw.ffn.nbytes + lw.weight_bytes + lw.attn.cache_bytes for lw in self.layers)

    def read_bytes_per_step(self) -> int:
        """Weight bytes every step reads besides the active FFN rows: attention of its heads,
        predictors, output head (the roofline numerator of the dense parts)."""
        return self.out_w.numel() * self.out_w.element_size() + sum(lw.weight_bytes for lw in self.layers)


def _rows(w: torch.Tensor, qtype: str | None, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of a float or quantized matrix, as fp32 [len(idx), cols]."""
    return w[idx].float() if qtype is None else dequantize(w[idx], qtype)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else (a if b is None else a + b)
