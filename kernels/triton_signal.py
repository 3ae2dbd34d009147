"""Triton kernels with which a captured CUDA graph talks to a process on the host through
page-locked memory (`signal.post_request`, `signal.await_answer`, `signal.stamp`): the GPU
reads and writes the host's flags over PCIe itself, so a decode step with exchanges is one graph
and no host thread stands between an answer and the next kernel.

Each kernel is one program of one warp. Host memory is addressed through its device view (with
unified addressing a registered page's device address is its host address). Ordering: the
request's fields are stored, then a system-scope fence, then the sequence number, so a host
thread that sees the number sees the fields (and the copies that ran before the kernel, which
the stream completed first). The answer is polled with volatile loads (never cached). Times are
the GPU's global timer in ns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _now(dep):
    """The global timer (ns), read after ``dep`` is known (the data dependency orders it)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dep], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _fenced(x):
    """x, after a system-scope fence: every store before it is seen by the host before a store of x."""
    return tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _post_kernel(seq_ptr, dst_ptr, src_ptr, stamp_ptr, NF: tl.constexpr, NP: tl.constexpr):
    offs = tl.arange(0, NP)
    fields = tl.load(src_ptr + offs, mask=offs < NF, other=0)
    tl.store(dst_ptr + offs, fields, mask=offs < NF)
    seq = _fenced(tl.load(seq_ptr, volatile=True) + 1)
    tl.store(seq_ptr, seq)
    tl.store(stamp_ptr, _now(_fenced(seq)))


@triton.jit
def _await_kernel(req_ptr, resp_ptr, stamp_ptr):
    want = tl.load(req_ptr, volatile=True)
    t0 = _now(want)
    got = tl.load(resp_ptr, volatile=True)
    while got < want:
        got = tl.load(resp_ptr, volatile=True)
    tl.store(stamp_ptr, t0)
    tl.store(stamp_ptr + 1, _now(got))


@triton.jit
def _stamp_kernel(stamp_ptr):
    tl.store(stamp_ptr, _now(tl.program_id(0).to(tl.int64)))


def post_request(seq: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, stamp: torch.Tensor) -> None:
    """Copy the request's fields src -> dst (int64 [F], F <= 8), then seq += 1 (int64 [1]; dst and
    seq in host memory seen by the host after it in that order); stamp[0] = the time of posting."""
    nf = src.numel()
    assert nf <= 8 and seq.dtype == dst.dtype == src.dtype == stamp.dtype == torch.int64
    _post_kernel[(1,)](seq, dst, src, stamp, NF=nf, NP=8, num_warps=1)


def await_answer(req: torch.Tensor, resp: torch.Tensor, stamp: torch.Tensor) -> None:
    """Wait until resp[0] >= req[0] (int64, host memory, written by the host); stamp[0:2] = when
    the wait began and when it saw the answer."""
    _await_kernel[(1,)](req, resp, stamp, num_warps=1)


def stamp(out: torch.Tensor) -> None:
    """out[0] = the GPU's global timer (int64 ns) when the stream reaches this kernel."""
    _stamp_kernel[(1,)](out, num_warps=1)


@triton.jit
def _store_rows_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def store_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src (contiguous, same dtype and size; dst typically host memory seen through a
    device view): a kernel's stores, no copy engine."""
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.numel() == dst.numel()
    n = src.numel()
    _store_rows_kernel[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=4)
