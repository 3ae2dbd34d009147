"""The GPU path of the sparse FFN: which Triton kernel runs a call (imported lazily: triton is
optional).

T == 1 (decode of one sequence): the fused kernel (triton_fused.py), one launch, on float rows and
on quantized rows in host memory (zero-copy: whole rows, read contiguously over PCIe); the two-stage
elementwise kernels on quantized rows in the GPU's memory. T > 1: the two-stage kernels
(triton_stages.py), up stage then down stage, tl.dot over tokens padded to 16.
Calls of more than MAX_T tokens run in blocks of MAX_T. Weights are fp32 / fp16 / bf16 rows or
ggml Q4_0 / Q8_0 rows (qtype), dequantized in registers by the same kernels.

`n_active` (device int32 [1]) bounds K inside the kernels: no host sync, CUDA-graph safe.
"""
from __future__ import annotations

import torch

from .triton_fused import sparse_ffn_fused
from .triton_stages import Config, launch_down, launch_up

__all__ = ["CONFIGS", "Config", "MAX_T", "config_for", "launch_down", "launch_up", "sparse_ffn_triton"]

# Tokens per launch: the T > 1 kernels keep [TP, BD] token tiles in shared memory. Not 64: with
# TP = 64 the H200 gave wrong results (GPU test test_triton_at_llama13b_shape), likely where Triton
# switches a 64-row tl.dot to Hopper's wgmma; TP <= 32 is right at every shape tested.
MAX_T = 32

# The winners of `bench/kernels_bench.py --sweep` on the H200 (10 % density of the Llama-2-13B
# FFN, fp16): T == 1 the fused kernel (2 rows per block, 4 warps, 2 programs per SM, lazy down
# rows; its two-stage tiles, the elementwise kernels, are what a Config with fused_r = 0 runs);
# T > 1 the two-stage tl.dot kernels. Quantized rows at T == 1: in the GPU's memory the two stages
# ("qgemv"), in host memory the fused kernel ("qhost"), chosen on the H100 by
# bench/zerocopy_bench.py --qtype q4_0 (kernels/README.md).
CONFIGS = {
    "gemv": Config(up_bk=4, up_bd=1024, up_warps=4, down_bk=128, down_bd=32, down_warps=8,
                   up_dot=False, down_dot=False, fused_r=2, fused_warps=4, fused_progs=2, eager_down=False),
    "qgemv": Config(up_bk=4, up_bd=1024, up_warps=4, down_bk=128, down_bd=32, down_warps=8,
                    up_dot=False, down_dot=False),
    "qhost": Config(up_bk=4, up_bd=1024, up_warps=4, down_bk=128, down_bd=32, down_warps=8,
                    up_dot=False, down_dot=False, fused_r=1, fused_warps=4, fused_progs=2, eager_down=False),
    "dot": Config(up_bk=32, up_bd=256, up_warps=8, down_bk=256, down_bd=32, down_warps=4, down_stages=4),
}


def config_for(T: int, qtype: str | None = None, host: bool = False) -> Config:
    """The default tiles of a call of T tokens (on rows of qtype; host: in page-locked host memory)."""
    if T > 1:
        return CONFIGS["dot"]
    return CONFIGS["gemv" if qtype is None else "qhost" if host else "qgemv"]


def sparse_ffn_triton(x, up, gate, down_t, idx, mask, act, up_bias, out, n_active,
                      cfg: Config | None = None, *, qtype: str | None = None, act_threshold: float | None = None,
                      act_on: str = "gate", gate_pre: torch.Tensor | None = None, host: bool = False) -> torch.Tensor:
    """The GPU path of `sparse_ffn.sparse_ffn` (arguments already checked there; host: the rows are
    page-locked host memory, `config_for`)."""
    T, D = x.shape
    if up.stride(1) != 1 or down_t.stride(1) != 1 or (gate is not None and gate.stride(1) != 1):
        raise ValueError("sparse_ffn (triton): weight rows need unit column stride")
    if T > MAX_T:  # the tl.dot tiles hold all tokens: blocks of MAX_T (masks of T > 32 are bool)
        y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
        for t0 in range(0, T, MAX_T):
            sl = slice(t0, min(T, t0 + MAX_T))
            sparse_ffn_triton(x[sl], up, gate, down_t, idx, None if mask is None else mask[sl], act, up_bias,
                              y[sl], n_active, cfg, qtype=qtype, act_threshold=act_threshold, act_on=act_on,
                              gate_pre=None if gate_pre is None else gate_pre[sl], host=host)
        return y
    swiglu = dict(act_threshold=act_threshold, act_on=act_on, gate_pre=gate_pre)
    cfg = cfg or config_for(T, qtype, host)
    x = x.contiguous()
    idx = idx if idx.is_contiguous() else idx.contiguous()
    if mask is not None:
        mask = mask.contiguous()
    if n_active is not None:
        n_active = n_active.reshape(1).to(torch.int32)
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 1 and cfg.fused:
        sparse_ffn_fused(x, up, gate, up_bias, down_t, idx, mask, n_active, act, y, cfg, qtype=qtype, **swiglu)
        return y
    h = torch.empty((T, max(1, idx.shape[0])), dtype=torch.float32, device=x.device)  # [T, K]
    launch_up(x, up, gate, up_bias, idx, mask, n_active, act, h, cfg, qtype, **swiglu)
    launch_down(h, down_t, idx, n_active, y, cfg, qtype)
    return y
