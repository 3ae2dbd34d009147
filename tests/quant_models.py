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

from powerinfer_ray.kernels import round_q8_0
from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.quants import QTYPES
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import tiny_weights


class KernelReference(ReferenceModel):
    """The dense forward over a quantized file's exactly dequantized weights (float64), with the
    input of every product with a Q8_0 / Q4_0 matrix rounded to Q8_0 first, as the CPU kernels
    quantize their activation (ggml's ``vec_dot_q4_0_q8_0``): q/k/v and o, up and gate, the
    output head. The down projection's input is not rounded: the kernel adds the dequantized down
    rows scaled by the activation in float. GPU kernels multiply x as it is: compare them with
    the plain ``ReferenceModel``."""

    quantized: frozenset[str] = frozenset()  # names of the tensors the file stores in blocks
    head_name = K.global_tensor(K.OUTPUT)  # the head's tensor in the file (token_embd when tied)

    @classmethod
    def from_file(cls, path, dtype: torch.dtype = torch.float64, device="cpu",  # noqa: ANN001
                  thresholded: bool = True) -> "KernelReference":
        mf = path if isinstance(path, ModelFile) else ModelFile(path)
        ref = super().from_file(mf, dtype, device, thresholded)
        ref.quantized = frozenset(n for n in mf.tensors if mf.dtype_of(n) in QTYPES)
        if not mf.has(ref.head_name):
            ref.head_name = K.global_tensor(K.TOKEN_EMBD)
        return ref

    def _rounded(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return round_q8_0(x).to(x.dtype) if name in self.quantized else x

    def _linear(self, x: torch.Tensor, tmpl: str, l: int) -> torch.Tensor:
        if tmpl != K.FFN_UP:  # ffn_pre rounded up's (and gate's) input
            x = self._rounded(x, K.tensor(tmpl, l))
        return super()._linear(x, tmpl, l)

    def ffn_pre(self, l: int, x: torch.Tensor):  # noqa: ANN201
        return super().ffn_pre(l, self._rounded(x, K.tensor(K.FFN_UP, l)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self._rounded(self._norm(x, K.OUTPUT_NORM, None), self.head_name) @ self.w[K.global_tensor(K.OUTPUT)].T


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


