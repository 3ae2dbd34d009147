"""Dense rows times x on any device, for weights in any format the kernels take: the attention
projections, the output head and the predictor's GEMVs on quantized weights.

Dimension legend: T tokens (any leading dims), D columns of W, R rows of W.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ffn
from .quant import check_matrix, dequantize

_triton_failed = False


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, qtype: str | None = None,
           threads: int | None = None) -> torch.Tensor:
    """y [..., R] float32 = x [..., D] . W^T + bias. w [R, D] float, or quantized rows uint8
    [R, D // 32 * block bytes] of qtype ('q4_0' | 'q8_0'). CPU tensors: the compiled kernel
    (cpu_ffn.linear: quantized rows against a Q8_0-quantized x, as ggml's); CUDA tensors: the
    Triton GEMV dequantizing in registers (x as it is), torch for float weights."""
    global _triton_failed
    D = x.shape[-1]
    if qtype is not None:
        check_matrix(w, qtype, D, "w", "linear")
    if not x.is_cuda:
        return cpu_ffn.linear(x, w, bias, threads, qtype=qtype)
    if qtype is None:
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)).float()
    if not _triton_failed:
        try:
            from .triton_linear import linear_triton
        except ImportError:  # no triton: remember, use torch
            _triton_failed = True
        else:
            y = linear_triton(x.reshape(-1, D), w, qtype, bias)
            return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x.float(), dequantize(w, qtype), None if bias is None else bias.float())


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               qtype: str | None = None) -> torch.Tensor:
    """The float64 reference of `linear` over the exactly dequantized rows (for the CPU kernel on
    quantized rows pass x = quant.round_q8_0(x), the activation it multiplies)."""
    wd = w.double() if qtype is None else dequantize(w, qtype, torch.float64)
    y = x.double() @ wd.T
    return y if bias is None else y + bias.double()
