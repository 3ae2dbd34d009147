"""Sparse FFN: compute only a shard's active neurons, reading each active row once.

Dimension legend:
  T tokens (1..32 in decode/small prefill)   D n_embd   N rows (neurons) of the shard
  K active neurons: the union over tokens of the shard's active neuron ids (idx)

A neuron j of the shard owns row j of `up`, `gate` and `down_t` (down_t = the down projection
stored transposed, so row j is neuron j's output column). For each token t:

    u = up[j] . x[t] + b[j]     g = gate[j] . x[t]
    h = act(g, u):  relu  -> relu(u)            (OPT / Falcon; no gate)
                    reglu -> relu(g) * u        (ReluLLaMA, ProSparse)
                    drelu -> relu(g) * relu(u)  (Bamboo, TurboSparse)
                    swiglu-> silu(g) * u
    y[t] = sum_k mask[t, k] * h[t, idx[k]] * down_t[idx[k]]

Partial outputs over disjoint neuron sets add up to the dense FFN output (down bias excluded:
the merge adds it once). Accumulation is fp32; y has x's dtype.

SwiGLU activation sparsity (a model sparsified with per-layer thresholds, CATS-style) takes two
options. ``act_threshold`` t: h[t, j] is zeroed where its criterion is not above t, the criterion
|SiLU(g)| (``act_on='gate'``) or |h| (``'h'``); a row whose h is zero for every token skips its
down row. ``gate_pre`` [T, N] fp32: the gate pre-activations g of all N rows, computed beforehand
(the gate-first mode computes the gate of every row densely, thresholds it and calls the sparse
FFN over the rows above the threshold): the kernel takes g from there and does not read the gate
rows again (``gate`` may then be None). The CPU kernel does gate-first inside one call instead:
with ``act_threshold`` on 'gate' a row's gate dots come first and a row below the threshold for
every token reads neither its up nor its down row.

Weights are fp32 / fp16 / bf16 [N, D], or with `qtype` ('q4_0' | 'q8_0') ggml blocks uint8
[N, D // 32 * block bytes] (quant.py): the Triton and CPU kernels dequantize the active rows in
registers (the CPU kernel multiplies a Q8_0-quantized x, as ggml does), the torch path gathers
and dequantizes them.

Backends (`sparse_ffn` picks): CUDA tensors -> Triton kernels (triton_ffn.py), falling back to
torch, and for GEMM_MIN_T tokens or more the matrix multiplies of torch_ffn.sparse_ffn_gemm over
every row in the compute dtype (h zeroed outside the active rows); CPU tensors -> the compiled
OpenMP kernel (cpu_ffn.py), falling back to torch. The torch path gathers the active rows
(index_select) and multiplies: correct everywhere, but it reads the active bytes twice and
writes them once.

Masks come in two forms: bool [T, K] or int32 [K] token bitmasks (bit t set = active for token
t, T <= 32), the form `predictor.split_active_packed` produces without a host sync. With
`n_active` (a one-element int tensor on x's device) only the first n_active entries of idx and
of the mask are used: the count stays on the device, so GPU calls need no host sync and can be
captured in CUDA graphs.
"""
from __future__ import annotations

import torch

from . import cpu_ffn
from .quant import check_matrix, check_qtype, row_bytes
from .torch_ffn import ACT_ON, ACTS, sparse_ffn_gemm, sparse_ffn_torch

BACKENDS = ("auto", "triton", "gemm", "cpu", "torch")
# More tokens than the Triton kernels take in one launch (triton_ffn.MAX_T): on CUDA such a call
# (a prompt chunk) runs as matrix multiplies over every row (torch_ffn.sparse_ffn_gemm), each row
# read once, instead of Triton launches that read every active row once per MAX_T tokens.
GEMM_MIN_T = 33


def takes_gemm(x: torch.Tensor) -> bool:
    """Whether sparse_ffn (backend auto) runs a call on x [T, D] as the matrix multiplies."""
    return x.is_cuda and x.shape[0] >= GEMM_MIN_T

_triton_failed = False


def _check(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active, qtype, act_threshold, act_on,
           gate_pre) -> None:
    """Shape / dtype / device checks that cost no device work (ValueError naming the field)."""
    def bad(what: str, got, expected: str) -> ValueError:
        return ValueError(f"sparse_ffn: {what} is {got}, expected {expected}")

    if x.dim() != 2:
        raise bad("x.shape", tuple(x.shape), "[T, D]")
    T, D = x.shape
    if act not in ACTS:
        raise bad("act", repr(act), f"one of {ACTS}")
    width = D
    if qtype is not None:
        check_matrix(up, check_qtype(qtype, "sparse_ffn"), D, "up", "sparse_ffn")
        width = row_bytes(qtype, D)
    if up.dim() != 2 or up.shape[1] != width:
        raise bad("up.shape", tuple(up.shape), f"[N, {D}]")
    N = up.shape[0]
    _check_swiglu_options(act, act_threshold, act_on, gate_pre, T, N, bad)
    if (gate is None and gate_pre is None) != (act == "relu"):
        raise bad("gate", "None" if gate is None else "given", f"{'None' if act == 'relu' else 'a tensor'} for act={act!r}")
    for name, w in (("gate", gate), ("down_t", down_t)):
        if w is not None and (w.dim() != 2 or w.shape[1] != width or w.shape[0] != N):
            raise bad(f"{name}.shape", tuple(w.shape), f"[{N}, {width}] like up")
        if w is not None and w.dtype != up.dtype:
            raise bad(f"{name}.dtype", w.dtype, f"{up.dtype} like up")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise bad("idx", f"{tuple(idx.shape)} {idx.dtype}", "[K] integer")
    K = idx.shape[0]
    if mask is not None:
        if mask.dtype == torch.bool:
            if tuple(mask.shape) != (T, K):
                raise bad("mask.shape", tuple(mask.shape), f"[{T}, {K}] (bool [T, K])")
        elif mask.dtype == torch.int32:
            if tuple(mask.shape) != (K,) or T > 32:
                raise bad("mask", f"int32 {tuple(mask.shape)} with T={T}", f"int32 bits [{K}] and T <= 32")
        else:
            raise bad("mask.dtype", mask.dtype, "bool [T, K] or int32 bits [K]")
    if up_bias is not None and tuple(up_bias.shape) != (N,):
        raise bad("up_bias.shape", tuple(up_bias.shape), f"[{N}]")
    if out is not None and (tuple(out.shape) != (T, D) or out.dtype != x.dtype or not out.is_contiguous()):
        raise bad("out", f"{tuple(out.shape)} {out.dtype}", f"contiguous [{T}, {D}] {x.dtype}")
    if n_active is not None and n_active.numel() != 1:
        raise bad("n_active.numel()", n_active.numel(), "1")
    devs = {t.device for t in (x, up, gate, down_t, idx, mask, up_bias, out, n_active, gate_pre) if t is not None}
    if len(devs) != 1:
        raise bad("devices", sorted(map(str, devs)), "one device for every tensor")


def _check_swiglu_options(act, act_threshold, act_on, gate_pre, T: int, N: int, bad) -> None:  # noqa: ANN001
    if act_threshold is not None:
        if act != "swiglu":
            raise bad("act", repr(act), "'swiglu' with act_threshold (thresholds are SwiGLU's activation sparsity)")
        if not isinstance(act_threshold, (int, float)) or not act_threshold >= 0 or act_threshold == float("inf"):
            raise bad("act_threshold", act_threshold, "a finite number >= 0, or None")
        if act_on not in ACT_ON:
            raise bad("act_on", repr(act_on), f"one of {ACT_ON}")
    if gate_pre is not None:
        if act == "relu":
            raise bad("gate_pre", "given", "None for act='relu' (no gate)")
        if gate_pre.dtype != torch.float32 or tuple(gate_pre.shape) != (T, N) or gate_pre.stride(1) != 1:
            raise bad("gate_pre", f"{gate_pre.dtype} {tuple(gate_pre.shape)}", f"float32 [{T}, {N}] with unit column stride")


def sparse_ffn(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
               idx: torch.Tensor, mask: torch.Tensor | None = None, act: str = "reglu",
               up_bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
               n_active: torch.Tensor | None = None, threads: int | None = None,
               backend: str = "auto", qtype: str | None = None, act_threshold: float | None = None,
               act_on: str = "gate", gate_pre: torch.Tensor | None = None, host: bool = False) -> torch.Tensor:
    """y [T, D] = the shard's FFN output over its active neurons idx (see the module docstring).

    x [T, D]; up, gate (None for act='relu'), down_t [N, D] of one float dtype, or uint8
    [N, D // 32 * block bytes] of qtype ('q4_0' | 'q8_0'); idx [K] int, 0 <= idx < N, any
    order; mask None | bool [T, K] | int32 bits [K]; up_bias [N] or None; out [T, D] (x's dtype,
    contiguous) or None; n_active: one-element int tensor, use only idx[:n_active]; threads: CPU
    kernel threads (default torch.get_num_threads()); backend: 'auto' | 'triton' | 'gemm' | 'cpu' |
    'torch' (auto: gemm for a CUDA call of GEMM_MIN_T tokens or more without n_active, else triton;
    the CPU kernel on the CPU);
    act_threshold (act='swiglu'), act_on ('gate' | 'h'), gate_pre float32 [T, N]: see the module
    docstring. Out-of-range idx raise IndexError on the CPU kernel; on the GPU they are a
    precondition (checking would cost a host sync). host: a CUDA call's rows are page-locked host
    memory read over PCIe (zero-copy): the Triton kernels' tiles for that.
    """
    global _triton_failed
    _check(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active, qtype, act_threshold, act_on, gate_pre)
    swiglu = dict(act_threshold=act_threshold, act_on=act_on, gate_pre=gate_pre)
    if backend not in BACKENDS:
        raise ValueError(f"sparse_ffn: backend is {backend!r}, expected one of {BACKENDS}")
    T, D = x.shape
    if idx.numel() == 0 and n_active is None:
        return out.zero_() if out is not None else torch.zeros_like(x)
    if backend == "auto":
        backend = "torch"
        if takes_gemm(x) and n_active is None:
            backend = "gemm"
        elif x.is_cuda and not _triton_failed:
            backend = "triton"
        elif x.device.type == "cpu" and gate_pre is None and (qtype is not None or up.dtype in (
                torch.float32, torch.float16, torch.bfloat16)):
            backend = "cpu" if cpu_ffn.available() else "torch"
    if backend == "cpu" and x.device.type != "cpu":
        raise ValueError(f"sparse_ffn: backend 'cpu' needs CPU tensors, got {x.device}")
    if backend == "triton" and not x.is_cuda:
        raise ValueError(f"sparse_ffn: backend 'triton' needs CUDA tensors, got {x.device}")
    if backend == "cpu" and gate_pre is not None:
        raise ValueError("sparse_ffn: backend 'cpu' takes no gate_pre (its gate-first runs inside the kernel: "
                         "pass act_threshold with act_on='gate' and every row)")
    if backend == "triton":
        try:
            from . import triton_ffn
        except ImportError:  # no triton: remember, use torch
            _triton_failed = True
            return sparse_ffn_torch(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active, qtype, **swiglu)
        return triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active, qtype=qtype,
                                            host=host, **swiglu)
    if backend == "gemm":
        if n_active is not None:
            raise ValueError("sparse_ffn: backend 'gemm' takes no n_active (pass idx[:n] instead)")
        return sparse_ffn_gemm(x, up, gate, down_t, idx, mask, act, up_bias, out, qtype, **swiglu)
    if backend == "cpu":
        if n_active is not None:
            K = min(int(n_active.reshape(-1)[0]), idx.shape[0])
            idx = idx[:K]
            if mask is not None:
                mask = mask[:, :K] if mask.dtype == torch.bool else mask[:K]
        y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
        return cpu_ffn.sparse_ffn_cpu(x, up, gate, down_t, idx, mask, act, up_bias, y, threads, qtype=qtype,
                                      act_threshold=act_threshold, act_on=act_on)
    return sparse_ffn_torch(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active, qtype, **swiglu)
