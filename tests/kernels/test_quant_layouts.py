"""Repacked Q4_0 rows (kernels.quant.repack: what a CUDA primary holds for the matrices only the
dense GEMV reads) and the dense GEMV's paths that run without a GPU, against gguf-py's own
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


def test_repacked_rows_hold_the_same_weights():
    """Every value of the repacked rows (dequantize of 'q4_0r') is gguf-py's value of the block it
    came from; the row's bytes are its blocks' quants in order, then their scales; the in-place form
    writes the same bytes into the same storage."""
    gen = torch.Generator().manual_seed(2)
    R, C = 7, 32 * 6
    w = blocks(R, C, "q4_0", gen)
    r = quant.repack(w, "q4_0")
    assert r.shape == w.shape and r.dtype == torch.uint8 and r.is_contiguous()
    assert np.array_equal(quant.dequantize(r, "q4_0r").numpy(), gguf_dequantize(w.numpy(), GQ.Q4_0))
    b = w.view(R, C // 32, 18)
    assert torch.equal(r[:, :C // 32 * 16], b[:, :, 2:].reshape(R, -1))
    assert torch.equal(r[:, C // 32 * 16:], b[:, :, :2].reshape(R, -1))
    same = w.clone()
    ptr = same.data_ptr()
    assert quant.repack_(same, "q4_0", chunk_bytes=3 * w.shape[1]) == "q4_0r"  # chunks of 3 rows
    assert same.data_ptr() == ptr and torch.equal(same, r)


def test_repack_refuses_what_it_does_not_take():
    """Rows of an odd number of Q4_0 blocks (not whole 32-bit words), and Q8_0 blocks, by name."""
    gen = torch.Generator().manual_seed(3)
    w = blocks(3, 32 * 5, "q4_0", gen)  # 90 bytes a row
    assert not quant.repackable(w, "q4_0") and not quant.repackable(w, None)
    with pytest.raises(ValueError, match=r"repack: q4_0 rows of shape \(3, 90\)"):
        quant.repack(w, "q4_0")
    w8 = blocks(3, 32 * 4, "q8_0", gen)
    assert not quant.repackable(w8, "q8_0")
    with pytest.raises(ValueError, match="repack: qtype is 'q8_0'"):
        quant.repack(w8, "q8_0")


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_dense_gemv_paths_without_a_gpu(qtype):
    """linear on repacked Q4_0 rows off CUDA, and dequantized_linear (the prompt chunks' path) with
    chunks of a few rows, equal float64 over gguf-py's values; the FFN kernels, which read the
    file's blocks, refuse repacked rows by name."""
    gen = torch.Generator().manual_seed(4)
    R, C = 37, 32 * 8
    w = blocks(R, C, qtype, gen)
    b = torch.randn(R, generator=gen)
    x = torch.randn(5, C, generator=gen)
    ref = torch.from_numpy(x.double().numpy() @ gguf_dequantize(w.numpy(), GQT[qtype]).astype(np.float64).T) + b.double()
    assert torch.allclose(linear_ref(x, w, b, qtype), ref)
    forms = [(w, qtype)] + ([(quant.repack(w, qtype), quant.REPACKED[qtype])] if qtype in quant.REPACKED else [])
    for wf, q in forms:
        y = dequantized_linear(x, wf, q, b, chunk_bytes=5 * C * 4)  # 5 rows a chunk: a ragged last one
        assert y.dtype == torch.float32 and rel_err(y, ref) < TOL[torch.float32], q
    if qtype in quant.REPACKED:  # (the file's blocks on the CPU: the compiled kernel, x as Q8_0: test_cpu_quant)
        r, rq = forms[1]
        assert rel_err(linear(x, r, b, qtype=rq), ref) < TOL[torch.float32]
        with pytest.raises(ValueError, match=f"qtype is '{rq}'"):
            sparse_ffn(x, r, r, r, torch.arange(4, dtype=torch.int32), act="reglu", qtype=rq)
