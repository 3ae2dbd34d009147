"""Dense rows times x on any device, for weights in any format the kernels take: the attention
projections, the output head and the predictor's GEMVs on quantized weights.

Dimension legend: T tokens (any leading dims), D columns of W, R rows of W.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ffn
from .quant import GEMV_QTYPES, QTYPES, check_matrix, dequantize

_triton_failed = False
GEMV_MAX_T = 32  # more tokens on CUDA: dequantized row chunks through cuBLAS (`dequantized_linear`)
CHUNK_BYTES = 8 << 20  # their dequantized rows at a time (with torch's temporaries, within the workspace's GEMM chunks)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, qtype: str | None = None,
           threads: int | None = None, relu: bool = False) -> torch.Tensor:
    """y [..., R] float32 = x [..., D] . W^T + bias, then max(y, 0) with ``relu``. w [R, D] float, or
    quantized rows uint8 [R, D // 32 * block bytes] of qtype: 'q4_0' | 'q8_0' blocks, or repacked
    Q4_0 rows 'q4_0r' (quant.repack). CPU tensors: the compiled kernel (cpu_ffn.linear: blocks
    against a Q8_0-quantized x, as ggml's). CUDA tensors: torch for float weights; up to GEMV_MAX_T
    tokens the Triton GEMVs dequantizing in registers (x as it is; blocks: the ReLU in the same
    kernel; repacked rows: triton_qgemv), more tokens `dequantized_linear`."""
    global _triton_failed
    D = x.shape[-1]
    if qtype is not None:
        check_matrix(w, qtype, D, "w", "linear", GEMV_QTYPES)
    if not x.is_cuda and (qtype is None or qtype in QTYPES):
        y = cpu_ffn.linear(x, w, bias, threads, qtype=qtype)
    elif qtype is None:
        y = F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)).float()
    else:
        x2 = x.reshape(-1, D)
        if x.is_cuda and not _triton_failed and x2.shape[0] <= GEMV_MAX_T:
            try:
                from .triton_linear import linear_triton
                from .triton_qgemv import qgemv_triton
            except ImportError:  # no triton: remember, use torch
                _triton_failed = True
            else:
                if qtype in QTYPES:
                    return linear_triton(x2, w, qtype, bias, relu).view(*x.shape[:-1], w.shape[0])
                y = qgemv_triton(x2, w, qtype, bias).view(*x.shape[:-1], w.shape[0])
                return y.relu_() if relu else y
        y = dequantized_linear(x2, w, qtype, bias).view(*x.shape[:-1], w.shape[0])
    return y.relu_() if relu else y


def dequantized_linear(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                       chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """y [T, R] float32 = x [T, D] . dequantize(w, qtype)^T + bias, the rows dequantized a chunk
    of about ``chunk_bytes`` at a time into x's dtype (fp16 / bf16; else fp32) and multiplied by
    torch: each row read once whatever T is (the form for a prompt chunk's many tokens)."""
    T, D = x.shape
    R = w.shape[0]
    dt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    xc = x.to(dt)
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    step = max(1, chunk_bytes // (D * torch.finfo(dt).bits // 8))
    for a in range(0, R, step):
        b = min(R, a + step)
        y[:, a:b] = xc @ dequantize(w[a:b], qtype, dt).T
    return y if bias is None else y.add_(bias.float())


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               qtype: str | None = None) -> torch.Tensor:
    """The float64 reference of `linear` over the exactly dequantized rows (for the CPU kernel on
    quantized rows pass x = quant.round_q8_0(x), the activation it multiplies)."""
    wd = w.double() if qtype is None else dequantize(w, qtype, torch.float64)
    y = x.double() @ wd.T
    return y if bias is None else y + bias.double()
