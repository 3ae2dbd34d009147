"""Neuron-aware operators: pure functions of tensors, each with a float64 reference beside it.

- sparse_ffn / sparse_ffn_ref: a shard's FFN over its active neurons (Triton on CUDA, a compiled
  OpenMP kernel on the CPU, torch as fallback everywhere), on fp32 / fp16 / bf16 rows or ggml
  Q4_0 / Q8_0 rows (qtype; quant.py has the format, dequantize and the Q8_0 activation rounding).
- linear / linear_ref: dense rows times x on any device and weight format (the attention
  projections, the output head and the predictor on quantized weights).
- predictor_logits, split_active, split_active_packed (+ packed_views, unpack_active,
  local_index): which neurons are active, split between GPU and CPU.
- rope, head_attention / head_attention_ref: attention over a shard of heads with a KV cache;
  head_attention_step / decode_attention / rope_table: the decode token with device-side slots
  and positions (Triton on CUDA), for CUDA-graph capture.

Imports torch and numpy only; triton and the C++ compiler are used lazily when present. The
environment reads are the compiled kernels' cache folder and extra compiler flags (cpu_library).
"""
from .attention import decode_attention, head_attention, head_attention_ref, head_attention_step, rope, rope_table
from .linear import linear, linear_ref
from .predictor import (ActiveSplit, PackedSplit, local_index, packed_views, predictor_logits,
                        predictor_logits_ref, split_active, split_active_packed, token_bits, unpack_active)
from .quant import QTYPES, dequantize, quantize_q8_0, round_q8_0
from .sparse_ffn import sparse_ffn
from .torch_ffn import ACTS, bits_to_mask, sparse_ffn_ref, sparse_ffn_torch

__all__ = [
    "ACTS", "ActiveSplit", "PackedSplit", "QTYPES", "bits_to_mask", "decode_attention", "dequantize",
    "head_attention", "head_attention_ref", "head_attention_step", "linear", "linear_ref",
    "local_index", "packed_views", "predictor_logits", "predictor_logits_ref", "quantize_q8_0", "rope",
    "round_q8_0", "rope_table", "sparse_ffn", "sparse_ffn_ref", "sparse_ffn_torch", "split_active",
    "split_active_packed", "token_bits", "unpack_active",
]
