"""Repacked Q4_0 / Q8_0 rows (kernels.quant.repack: what a CUDA primary holds for the matrices only
the dense GEMV reads) and the dense GEMV's paths that run without a GPU, against gguf-py's own
dequantizer and float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from powerinfer_ray.kernels import quant, sparse_ffn
from powerinfer_ray.kernels.linear import dequantized_linear, linear, linear_ref

from kernel_checks import TOL, rel_err

GQT = {"q4_0": GQ.Q4_0, "q8_0": GQ.Q8_0}


def blocks(R: int, C: int, qtype: str, gen: torch.Generator) -> torch.Tensor:
    return torch.from_numpy(gguf_quantize(torch.randn(R, C, generator=gen).numpy(), GQT[qtype]))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_repacked_rows_hold_the_same_weights(qtype):
    """Every value of the repacked rows (dequantize of 'q4_0r' / 'q8_0r') is gguf-py's value of the
    block it came from; the row's bytes are its blocks' quants in order, then their scales; the
    in-place form writes the same bytes into the same storage."""
    gen = torch.Generator().manual_seed(2)
    R, C = 7, 32 * 6
    w = blocks(R, C, qtype, gen)
    r = quant.repack(w, qtype)
    rq = quant.REPACKED[qtype]
    assert r.shape == w.shape and r.dtype == torch.uint8 and r.is_contiguous()
    want = gguf_dequantize(w.numpy(), GQT[qtype])
    assert np.array_equal(quant.dequantize(r, rq).numpy(), want)
    bb = quant.BLOCK_BYTES[qtype]
    b = w.view(R, C // 32, bb)
    assert torch.equal(r[:, :C // 32 * (bb - 2)], b[:, :, 2:].reshape(R, -1))
    assert torch.equal(r[:, C // 32 * (bb - 2):], b[:, :, :2].reshape(R, -1))
    same = w.clone()
    ptr = same.data_ptr()
    assert quant.repack_(same, qtype, chunk_bytes=3 * w.shape[1]) == rq  # chunks of 3 rows
    assert same.data_ptr() == ptr and torch.equal(same, r)


def test_repack_refuses_rows_that_are_not_whole_words():
    w = blocks(3, 32 * 5, "q4_0", torch.Generator().manual_seed(3))  # 90 bytes a row
    assert not quant.repackable(w, "q4_0") and not quant.repackable(w, None)
    with pytest.raises(ValueError, match=r"repack: q4_0 rows of shape \(3, 90\)"):
        quant.repack(w, "q4_0")


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_dense_gemv_paths_without_a_gpu(qtype):
    """linear on repacked rows off CUDA, and dequantized_linear (the prompt chunks' path) with
    chunks of a few rows, equal float64 over gguf-py's values; the FFN kernels, which read the
    file's blocks, refuse repacked rows by name."""
    gen = torch.Generator().manual_seed(4)
    R, C = 37, 32 * 8
    w = blocks(R, C, qtype, gen)
    b = torch.randn(R, generator=gen)
    x = torch.randn(5, C, generator=gen)
    ref = torch.from_numpy(x.double().numpy() @ gguf_dequantize(w.numpy(), GQT[qtype]).astype(np.float64).T) + b.double()
    assert torch.allclose(linear_ref(x, w, b, qtype), ref)
    rq = quant.REPACKED[qtype]
    y = linear(x, quant.repack(w, qtype), b, qtype=rq)
    assert y.dtype == torch.float32 and rel_err(y, ref) < TOL[torch.float32]
    for wf, q in ((w, qtype), (quant.repack(w, qtype), rq)):
        y = dequantized_linear(x, wf, q, b, chunk_bytes=5 * C * 4)  # 5 rows a chunk: a ragged last one
        assert rel_err(y, ref) < TOL[torch.float32], q
    idx = torch.arange(4, dtype=torch.int32)
    r = quant.repack(w, qtype)
    with pytest.raises(ValueError, match=f"qtype is '{rq}'"):
        sparse_ffn(x, r, r, r, idx, act="reglu", qtype=rq)
