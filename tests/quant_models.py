"""Quantized test models and the reference the quantized runtime is checked against (shared by
tests/unit, tests/ray and tests/gpu).

``write_upstream_int4``: a model file in the layout of upstream PowerInfer's ``quantize ... Q4_0``,
written by gguf-py alone (an independent writer). ``KernelReference``: the dense forward over a
quantized file's dequantized weights, multiplying what ggml's CPU kernels multiply.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf import quants as gq

from powerinfer_ray.kernels import quantize_q8_0
from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.qtypes import QTYPES
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import tiny_weights


class KernelReference(ReferenceModel):
    """The dense forward over a quantized file's exactly dequantized weights (float64), with the
    input of every product with a Q8_0 / Q4_0 matrix rounded to Q8_0 first, as the CPU kernels
    quantize their activation (ggml's ``vec_dot_q4_0_q8_0``): q/k/v and o, up and gate, the
    output head. The down projection's input is not rounded: the kernel adds the dequantized down
    rows scaled by the activation in float. GPU kernels multiply x as it is: compare them with
    the plain ``ReferenceModel``.

    Rounding ties: where an activation lies within fp32 error of a half step (or a block's scale
    amax / 127 of the middle between two f16 values), the runtime's fp32 value may round the other
    way, and the one-step difference spreads through later roundings. ``forward`` records such
    decisions in ``ties`` (relative margin, key), and takes the other side of those in ``flips``
    (keys: the rounded tensor (its first matrix's name), row, block, element or -1 for the scale;
    rows are a ``forward`` call's tokens)."""

    quantized: frozenset[str] = frozenset()  # names of the tensors the file stores in blocks
    head_name = K.global_tensor(K.OUTPUT)  # the head's tensor in the file (token_embd when tied)
    flips: frozenset = frozenset()
    TIE = 1e-4  # relative margin under which a rounding decision is a tie: the runtime's fp32 activations
    # drift ~1e-6 a layer, but an element left by cancellation can be off by more, and another
    # CPU's sums (the kernels' -march=native build, torch's GEMMs) round differently: 1e-5 was too tight on CI

    @classmethod
    def from_file(cls, path, dtype: torch.dtype = torch.float64, device="cpu",  # noqa: ANN001
                  thresholded: bool = True) -> "KernelReference":
        mf = path if isinstance(path, ModelFile) else ModelFile(path)
        ref = super().from_file(mf, dtype, device, thresholded)
        ref.quantized = frozenset(n for n in mf.tensors if mf.dtype_of(n) in QTYPES)
        if not mf.has(ref.head_name):
            ref.head_name = K.global_tensor(K.TOKEN_EMBD)
        ref.ties = []
        return ref

    def forward(self, tokens, cache, hooks=None) -> torch.Tensor:  # noqa: ANN001
        self.ties = []
        return super().forward(tokens, cache, hooks)

    def _rounded(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name not in self.quantized:
            return x
        blocks = quantize_q8_0(x).reshape(*x.shape[:-1], -1, 34)  # [T, nb, 34]: the kernels' own rounding
        d16 = blocks[..., :2].contiguous().view(torch.float16)  # [T, nb, 1]
        q = blocks[..., 2:].contiguous().view(torch.int8).double()  # [T, nb, 32]
        b = x.float().reshape(q.shape)
        d = b.abs().amax(-1, keepdim=True) / 127  # [T, nb, 1] fp32, as quantize_q8_0
        v = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)  # [T, nb, 32]: q before rounding
        other = torch.nextafter(d16, torch.where(d16.float() > d, -torch.inf, torch.inf).half())  # the other f16
        mid = (d16.double() + other.double()) / 2
        q_margin = ((v.abs() - v.abs().floor() - 0.5).abs() / v.abs().clamp_min(1)).double()
        d_margin = ((d.double() - mid).abs() / d.double().clamp_min(1e-30))
        for (r, blk, e), m in _under(q_margin, self.TIE):
            self.ties.append((m, (name, r, blk, e)))
        for (r, blk, _), m in _under(d_margin, self.TIE):
            self.ties.append((m, (name, r, blk, -1)))
        scale = d16.double().clone()
        for n, r, blk, e in self.flips:
            if n != name:
                continue
            if e < 0:
                scale[r, blk, 0] = other[r, blk, 0].double()
            else:  # the other side of the half step
                q[r, blk, e] += 1.0 if v[r, blk, e] > q[r, blk, e] else -1.0
        return (q * scale).reshape(x.shape).to(x.dtype)

    def _linear(self, x: torch.Tensor, tmpl: str, l: int) -> torch.Tensor:
        if tmpl != K.FFN_UP:  # ffn_pre rounded up's (and gate's) input
            # q, k and v multiply one rounding of x (the runtime's one GEMV over wqkv): one name
            x = self._rounded(x, K.tensor(K.ATTN_Q if tmpl in (K.ATTN_K, K.ATTN_V) else tmpl, l))
        return super()._linear(x, tmpl, l)

    def ffn_pre(self, l: int, x: torch.Tensor):  # noqa: ANN201
        return super().ffn_pre(l, self._rounded(x, K.tensor(K.FFN_UP, l)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self._rounded(self._norm(x, K.OUTPUT_NORM, None), self.head_name) @ self.w[K.global_tensor(K.OUTPUT)].T


def _under(margin: torch.Tensor, tie: float) -> list[tuple[tuple[int, ...], float]]:
    """(index, margin) of the entries of margin [T, nb, k] below tie."""
    hits = (margin < tie).nonzero().tolist()
    return [((r, b, e), float(margin[r, b, e])) for r, b, e in hits]


def match_rounding(ref: KernelReference, tokens: list[int], got: list, at: list[int], tol: float = 1e-5,
                   max_flips: int = 6, hooks=None) -> tuple[list[float], frozenset]:  # noqa: ANN001
    """Relative errors of the runtime's logits ``got`` (one [V] per position in ``at``, ascending)
    against ``ref`` over ``tokens``, once the reference has taken the other side of the rounding
    ties the runtime took: while a step is off by more than tol, the ties of that step's tokens are
    flipped one at a time, then two at a time (the second a tie once the first is flipped: the
    runtime may have taken two ties of one step, neither of which explains the step alone), and
    the first flip that brings the step 10x closer is kept (until max_flips are kept). An error the
    ties cannot explain stays in the result. hooks: the reference forward's (``FFNHooks``)."""
    def errors(flips: frozenset, upto: int) -> list[float]:
        ref.flips = flips
        full = ref.forward(tokens[:upto + 1], ref.new_cache(), hooks)
        return [float((torch.as_tensor(g).double() - full[i]).abs().max() / full[i].abs().max())
                for g, i in zip(got, at) if i <= upto]

    def ties(first: int, last: int, flips: frozenset) -> list:  # of the last forward, closest first
        return [key for _, key in sorted(set(ref.ties)) if first <= key[1] <= last and key not in flips]

    def explain(flips: frozenset, bad: int, target: float) -> frozenset | None:  # ref.ties: under flips
        first = at[bad - 1] + 1 if bad else 0  # a flip that made this step the first one off: its rows
        singles = ties(first, at[bad], flips)
        for key in singles:
            if errors(flips | {key}, at[bad])[bad] < target:
                return flips | {key}
        for key in singles:
            errors(flips | {key}, at[bad])
            for second in ties(first, at[bad], flips | {key}):
                if errors(flips | {key, second}, at[bad])[bad] < target:
                    return flips | {key, second}
        return None

    flips = frozenset()
    errs = errors(flips, at[-1])
    while len(flips) < max_flips:
        bad = next((k for k, e in enumerate(errs) if e > tol), None)
        if bad is None:
            break
        found = explain(flips, bad, errs[bad] / 10)
        if found is None:
            break
        flips = found
        errs = errors(flips, at[-1])
    ref.flips = frozenset()
    return errs, flips


def k_blocks(rng: np.random.Generator, n_blocks: int, qt: T) -> np.ndarray:
    """Random K-quant blocks with small finite scales (gguf-py reads them; it has no quantizer
    for them). Q6_K, as upstream's quantize writes output.weight (210 bytes: ql[128], qh[64],
    int8 scales[16], f16 d); Q4_K (144 bytes: f16 d, f16 dmin, scales[12], qs[128])."""
    if qt == T.Q6_K:
        b = rng.integers(0, 256, (n_blocks, 210), dtype=np.uint8)
        b[:, 192:208] = rng.integers(-30, 31, (n_blocks, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = np.full((n_blocks, 1), 0.002, np.float16).view(np.uint8)
        return b
    b = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)
    b[:, 0:4] = np.full((n_blocks, 2), 0.001, np.float16).view(np.uint8)
    return b



def write_upstream_int4(path, cfg, rng, q4_k: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """A PowerInfer model in the layout of upstream's ``quantize ... Q4_0``, written by gguf-py
    alone (GGUFWriter + gguf.quants): Q4_0 for every matrix (token_embd, attention, FFN with
    ffn_down_t, predictors fc1/fc2), Q6_K output.weight, F32 norms, PWRI magic; the tensors
    named in ``q4_k`` as random Q4_K blocks instead. Returns the weights the file stands for
    (gguf-py's dequantization)."""
    w = GGUFWriter(path, "llama")
    a = "llama"
    for key, v in ((f"{a}.context_length", cfg.n_ctx), (f"{a}.embedding_length", cfg.n_embd),
                   (f"{a}.block_count", cfg.n_layer), (f"{a}.feed_forward_length", cfg.n_ff),
                   (f"{a}.attention.head_count", cfg.n_head), (f"{a}.attention.head_count_kv", cfg.n_head_kv),
                   (f"{a}.rope.dimension_count", cfg.head_dim), ("general.file_type", 2)):
        w.add_uint32(key, v)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("powerinfer.sparse_threshold", 0.0)
    out: dict[str, np.ndarray] = {}
    for name, t in tiny_weights(cfg, seed=5).items():
        x = t.float().numpy()
        if name == "output.weight" or name in q4_k:
            qt = T.Q4_K if name in q4_k else T.Q6_K
            data = k_blocks(rng, x.size // 256, qt).reshape(x.shape[0], -1)
            w.add_tensor(name, data, raw_dtype=qt)
            out[name] = gq.dequantize(data, qt)
        elif x.ndim == 2:
            data = gq.quantize(x, T.Q4_0)
            w.add_tensor(name, data, raw_dtype=T.Q4_0)
            out[name] = gq.dequantize(data, T.Q4_0)
        else:
            w.add_tensor(name, x)
            out[name] = x
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")
    return out


