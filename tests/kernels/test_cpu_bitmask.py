"""The CPU executor's exchange entry (cpu_ffn.sparse_ffn_bitmask: the packed mask decoded in C++)
and the compiled kernel's two work splits, against the float64 reference."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from powerinfer_ray.kernels import cpu_ffn, sparse_ffn_ref, token_bits

from kernel_checks import DTYPES, TOL, make_idx, make_shard, poisoned, rel_err

ACTS = ("relu", "reglu", "drelu", "swiglu")
needs_compiler = pytest.mark.skipif(not cpu_ffn.available(), reason="no C++ compiler: compiled kernel unavailable")


def pack(mask: torch.Tensor) -> np.ndarray:
    """bool [T, n] -> uint8 [T, ceil(n/8)], neuron j in bit j % 8 of byte j // 8 (the channel's layout)."""
    return np.packbits(mask.numpy(), axis=1, bitorder="little")


def token_mask(T: int, n: int, density, gen: torch.Generator) -> torch.Tensor:
    """bool [T, n]: each (token, neuron) set with probability `density`; 'one': a single bit."""
    if density == "one":
        m = torch.zeros(T, n, dtype=torch.bool)
        m[int(torch.randint(T, (1,), generator=gen)), int(torch.randint(n, (1,), generator=gen))] = True
        return m
    return torch.rand(T, n, generator=gen) < density


def reference(x, up, gate, down_t, mask, act, up_bias):
    """float64 y [T, D], pairs, rows of the exchange for bool mask [T, n] over rows 0 .. n-1."""
    idx = mask.any(0).nonzero().reshape(-1)
    y = sparse_ffn_ref(x, up, gate, down_t, idx, mask.index_select(1, idx), act, up_bias)
    return y, int(mask.sum()), idx.numel()


def check(x, up, gate, down_t, mask, act, up_bias, out_dtype, what, packed=None, n=None, **kw):
    T, D = x.shape
    n = mask.shape[1] if n is None else n
    out = poisoned((T, D), out_dtype)
    pairs, rows, down_rows = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, pack(mask) if packed is None else packed,
                                                        n, act, up_bias, out, **kw)
    ref, ref_pairs, ref_rows = reference(x, up, gate, down_t, mask, act, up_bias)
    assert (pairs, rows) == (ref_pairs, ref_rows), f"{what}: (pairs, rows) {(pairs, rows)} != {(ref_pairs, ref_rows)}"
    assert 0 <= down_rows <= rows, f"{what}: {down_rows} down rows read of {rows}"
    if ref_rows == 0:
        assert torch.equal(out, torch.zeros_like(out)), f"{what}: no active neuron must give zeros"
        return
    tol = max(TOL[x.dtype], TOL[up.dtype], TOL[out_dtype])
    err = rel_err(out, ref)
    assert err < tol, f"{what}: rel err {err:.2e} >= {tol:.0e}"


@needs_compiler
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitmask_matches_reference(act, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"bitmask{dtype}{act}".encode()))
    N, D = 203, 100  # n not a multiple of 8; D not a multiple of the SIMD width (scalar tails)
    for density in (0.0, "one", 0.01, 0.10, 0.50, 1.0):
        for T in (1, 2, 5, 8, 17, 32):
            up, gate, down_t, b = make_shard(N, D, dtype, act, T % 2 == 1, gen)
            x = torch.randn(T, D, generator=gen).to(dtype)
            mask = token_mask(T, N, density, gen)
            out_dtype = torch.float32 if T % 3 else dtype
            check(x, up, gate, down_t, mask, act, b, out_dtype, f"{act} {dtype} T={T} density={density} out={out_dtype}")


@needs_compiler
@pytest.mark.parametrize("split", ["auto", "rows", "cols"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_splits_and_threads(split, threads):
    gen = torch.Generator().manual_seed(threads)
    N, D = 1500, 160
    up, gate, down_t, b = make_shard(N, D, torch.float16, "reglu", True, gen)
    for T in (1, 4, 9, 32):  # at 9 and 32 most rows of a sparse mask are active for one token
        for density in (0.002, 0.05, 0.6):  # ~3, ~75 and ~900 rows: both auto choices at 1-3 threads
            x = torch.randn(T, D, generator=gen).half()
            mask = token_mask(T, N, density / T, gen)
            check(x, up, gate, down_t, mask, "reglu", b, torch.float32, f"{split} threads={threads} T={T} d={density}",
                  threads=threads, split=split)


@needs_compiler
@pytest.mark.parametrize("T", [64, 65, 130])
def test_more_than_64_tokens_run_in_blocks_and_count_the_union(T):
    gen = torch.Generator().manual_seed(T)
    N, D = 77, 48
    up, gate, down_t, _ = make_shard(N, D, torch.float32, "drelu", False, gen)
    x = torch.randn(T, D, generator=gen)
    mask = token_mask(T, N, 0.02, gen)
    check(x, up, gate, down_t, mask, "drelu", None, torch.float32, f"T={T}")


@needs_compiler
def test_channel_views_strided_mask_strided_x_torch_mask():
    """The mask as a row-slice of a wider buffer (the channel's [T_max, B_max] layout), or a torch
    uint8 tensor; x as rows of a wider buffer; padding bits past n are ignored."""
    gen = torch.Generator().manual_seed(12)
    N, D, T, n = 100, 64, 5, 91
    up, gate, down_t, _ = make_shard(N, D, torch.float16, "reglu", False, gen)
    mask = token_mask(T, n, 0.2, gen)
    wide = np.zeros((8, 40), dtype=np.uint8)
    wide[:T, :12] = pack(mask)
    wide[:T, 11] |= 0xF8  # bits 91..95: past n
    big_x = torch.randn(T, 3 * D, generator=gen).half()
    x = big_x[:, D:2 * D]  # row stride 3D
    check(x, up, gate, down_t, mask, "reglu", None, torch.float32, "strided numpy view", packed=wide[:T, :12], n=n)
    check(x, up, gate, down_t, mask, "reglu", None, torch.float16, "torch view",
          packed=torch.from_numpy(wide)[:T, :12], n=n)


@pytest.mark.parametrize("compiled", [True, False])
def test_prepared_call_on_the_first_rows_of_the_buffers(compiled, monkeypatch):
    """prepare_bitmask over buffers of 8 rows (the channel's x, packed mask and out at their
    capacity), called for T = 1, 3, 8 of their first rows, new values written between calls: each
    equals the float64 reference of those rows; out's later rows untouched; T past the capacity
    is refused. Also without the compiled kernel."""
    if compiled and not cpu_ffn.available():
        pytest.skip("no C++ compiler: compiled kernel unavailable")
    if not compiled:
        monkeypatch.setattr(cpu_ffn, "library", lambda: None)
    gen = torch.Generator().manual_seed(21)
    N, D, cap, n = 120, 64, 8, 101
    up, gate, down_t, b = make_shard(N, D, torch.float16, "reglu", True, gen)
    x = torch.zeros(cap, D, dtype=torch.float16)
    wide = np.zeros((cap, 16), dtype=np.uint8)  # rows of ceil(101 / 8) = 13 bytes used, as the channel's
    packed = wide.reshape(-1)[: cap * 13].reshape(cap, 13)
    out = torch.zeros(cap, D, dtype=torch.float16)
    call = cpu_ffn.prepare_bitmask(x, up, gate, down_t, packed, n, "reglu", b, out)
    for T in (1, 3, 8, 3):
        x[:T] = torch.randn(T, D, generator=gen).half()
        mask = token_mask(T, n, 0.2, gen)
        packed[:T] = pack(mask)
        out.fill_(7.0)
        pairs, rows, _ = call(T, 2)
        ref, ref_pairs, ref_rows = reference(x[:T], up, gate, down_t, mask, "reglu", b)
        assert (pairs, rows) == (ref_pairs, ref_rows)
        assert rel_err(out[:T], ref) < TOL[torch.float16]
        assert torch.equal(out[T:], torch.full_like(out[T:], 7.0))
    with pytest.raises(ValueError, match="T is 9"):
        call(9)


@needs_compiler
def test_no_mask_is_every_row_of_n():
    gen = torch.Generator().manual_seed(13)
    N, D, T, n = 50, 40, 3, 45
    up, gate, down_t, b = make_shard(N, D, torch.float32, "swiglu", True, gen)
    x = torch.randn(T, D, generator=gen)
    mask = torch.ones(T, n, dtype=torch.bool)
    out = poisoned((T, D), torch.float32)
    # SwiGLU is never exactly zero: every down row read
    assert cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None, n, "swiglu", b, out) == (T * n, n, n)
    assert rel_err(out, reference(x, up, gate, down_t, mask, "swiglu", b)[0]) < 1e-5


@needs_compiler
def test_same_as_the_executors_previous_path():
    """unpack_mask + ffn_partial (CPUExecutor._compute before this entry) gives the same y and stats."""
    from powerinfer_ray.runtime.channel import pack_mask, unpack_mask
    from powerinfer_ray.runtime.layers import ffn_partial
    from powerinfer_ray.runtime.shard import FFNShard

    gen = torch.Generator().manual_seed(14)
    N, D = 333, 128
    up, gate, down_t, _ = make_shard(N, D, torch.float16, "reglu", False, gen)
    shard = FFNShard(np.arange(N), up, gate, down_t, None)
    for T in (1, 4):
        x = torch.randn(T, D, generator=gen).half()
        packed = pack_mask(token_mask(T, N, 0.1, gen)).numpy()
        y_old = torch.empty(T, D)
        _, pairs_old, rows_old = ffn_partial(x.float(), shard, "reglu", "predictor", unpack_mask(packed, N), out=y_old)
        y_new = poisoned((T, D), torch.float32)
        stats = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, packed, N, "reglu", None, y_new)
        assert stats[:2] == (pairs_old, rows_old)
        assert rel_err(y_new, y_old) < 1e-5


def test_fallback_without_compiler(monkeypatch):
    monkeypatch.setattr(cpu_ffn, "library", lambda: None)
    gen = torch.Generator().manual_seed(15)
    N, D, T = 60, 24, 3
    up, gate, down_t, b = make_shard(N, D, torch.float32, "drelu", True, gen)
    x = torch.randn(T, D, generator=gen)
    check(x, up, gate, down_t, token_mask(T, N, 0.3, gen), "drelu", b, torch.float32, "torch fallback")
    check(x, up, gate, down_t, torch.zeros(T, N, dtype=torch.bool), "drelu", b, torch.float32, "fallback, empty")
    out = poisoned((T, D), torch.float32)
    assert cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None, N, "drelu", b, out) == (T * N, N, N)  # reads all
    assert rel_err(out, reference(x, up, gate, down_t, torch.ones(T, N, dtype=torch.bool), "drelu", b)[0]) < 1e-5


@needs_compiler
@pytest.mark.parametrize("split", ["rows", "cols"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bits"])
def test_index_entry_both_splits(split, mask_kind):
    """sparse_ffn_cpu (idx + mask) under either split, few and many rows, bf16 out."""
    gen = torch.Generator().manual_seed(16)
    N, D = 700, 72
    up, gate, down_t, b = make_shard(N, D, torch.bfloat16, "reglu", True, gen)
    for K in (1, 37, 650):
        for T in (1, 5, 12):
            idx = make_idx(K, N, gen)
            x = torch.randn(T, D, generator=gen).bfloat16()
            mask = None
            if mask_kind == "bool":
                mask = torch.rand(T, K, generator=gen) < 0.5
            elif mask_kind == "bits":
                mask = token_bits(torch.rand(T, K, generator=gen) < 0.5)
            out = poisoned((T, D), torch.bfloat16)
            cpu_ffn.sparse_ffn_cpu(x, up, gate, down_t, idx, mask, "reglu", b, out, threads=2, split=split)
            err = rel_err(out, sparse_ffn_ref(x, up, gate, down_t, idx, mask, "reglu", b))
            assert err < TOL[torch.bfloat16], f"{split} {mask_kind} K={K} T={T}: {err:.2e}"


@needs_compiler
@pytest.mark.parametrize("split", ["rows", "cols"])
@pytest.mark.parametrize("act", ["relu", "reglu"])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_down_rows_read_and_skip_zero(split, act, T):
    """Rows whose activation is zero for every token skip their down row (counted in the third
    value); skip_zero=False reads them as a dense FFN does. Same output either way. The rows are
    built so that each pre-activation's sign is known exactly: every token is a positive multiple
    of v, every up (ReLU) / gate (ReGLU) row +-v/|v|^2 plus a part orthogonal to v."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"down{split}{act}{T}".encode()))
    N, D, n = 300, 96, 280
    v = torch.randn(D, generator=gen, dtype=torch.float64)
    x = (torch.rand(T, 1, generator=gen, dtype=torch.float64) + 0.5) * v  # [T, D]: c_t v, c_t in [0.5, 1.5)
    sign = torch.where(torch.rand(N, generator=gen) < 0.4, 1.0, -1.0).double()  # ~40 % of rows fire
    noise = torch.randn(N, D, generator=gen, dtype=torch.float64)
    noise -= (noise @ v)[:, None] * v / (v @ v)  # orthogonal to v: no effect on the sign
    signed = sign[:, None] * v / (v @ v) + 0.1 * noise
    up, gate = (signed, torch.randn(N, D, generator=gen).double()) if act == "relu" else \
        (torch.randn(N, D, generator=gen).double(), signed)
    down_t = torch.randn(N, D, generator=gen, dtype=torch.float64)
    mask = torch.rand(T, n, generator=gen) < 0.5
    mask[0, :20] = True  # some rows active for any token
    active = mask.any(0)
    fires = active & (sign[:n] > 0)  # the rows whose down row must be read: hand count
    x32, w32 = x.float(), [w.float() for w in (up, gate, down_t)]
    g32 = w32[1] if act == "reglu" else None
    ref = reference(x32, w32[0], g32, w32[2], mask, act, None)[0]
    for skip in (True, False):
        out = poisoned((T, D), torch.float32)
        pairs, rows, down_rows = cpu_ffn.sparse_ffn_bitmask(x32, w32[0], g32, w32[2], pack(mask), n, act, None, out,
                                                            2, split=split, skip_zero=skip)
        assert (pairs, rows) == (int(mask.sum()), int(active.sum()))
        assert down_rows == (int(fires.sum()) if skip else rows), (skip, down_rows, int(fires.sum()), rows)
        assert rel_err(out, ref) < 1e-5
    out = poisoned((T, D), torch.float32)  # every row (policy 'dense'): all down rows unless skipped
    assert cpu_ffn.sparse_ffn_bitmask(x32, w32[0], g32, w32[2], None, n, act, None, out, 2, split=split,
                                      skip_zero=False) == (T * n, n, n)
    assert cpu_ffn.sparse_ffn_bitmask(x32, w32[0], g32, w32[2], None, n, act, None, out, 2, split=split) \
        == (T * n, n, int((sign[:n] > 0).sum()))


def _args(**kw):
    up = torch.randn(20, 16)
    a = dict(x=torch.randn(3, 16), up=up, gate=up, down_t=up, packed_mask=np.zeros((3, 3), np.uint8), n=20,
             act="reglu", up_bias=None, out=torch.zeros(3, 16))
    a.update(kw)
    return a


@pytest.mark.parametrize("kwargs, match", [
    (dict(packed_mask=np.zeros((3, 2), np.uint8)), "packed_mask.shape"),  # width: ceil(20/8) = 3 bytes
    (dict(packed_mask=np.zeros((3, 4), np.uint8)), "packed_mask.shape"),
    (dict(x=torch.randn(5, 16), out=torch.zeros(5, 16)), "packed_mask.shape"),  # T larger than the mask's
    (dict(x=torch.randn(4, 16)), "out"),  # T larger than out's
    (dict(packed_mask=np.zeros((3, 3), np.int8)), "packed_mask.dtype"),
    (dict(packed_mask=torch.zeros(3, 3, dtype=torch.int32)), "packed_mask.dtype"),
    (dict(packed_mask=[[0, 0, 0]] * 3), "packed_mask"),
    (dict(packed_mask=np.zeros((3, 6), np.uint8)[:, ::2]), "packed_mask.strides"),
    (dict(n=21), "n"),
    (dict(n=-1), "n"),
    (dict(n=2.0), "n"),
    (dict(x=torch.randn(3, 15)), "x.shape"),
    (dict(x=torch.randn(3, 16).double()), "x.dtype"),
    (dict(x=torch.randn(16, 3).T), "x"),
    (dict(out=torch.zeros(3, 16, dtype=torch.float16)), "out"),
    (dict(out=torch.zeros(16, 3).T), "out"),
    (dict(act="gelu"), "act"),
    (dict(gate=None), "gate"),
    (dict(down_t=torch.randn(19, 16)), "down_t.shape"),
    (dict(down_t=torch.randn(20, 16).half()), "down_t.dtype"),
    (dict(up_bias=torch.zeros(7)), "up_bias"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cpu_ffn.sparse_ffn_bitmask(**_args(**kwargs))


def test_bad_split_names_the_field():
    with pytest.raises(ValueError, match="split"):
        cpu_ffn.sparse_ffn_bitmask(**_args(), split="diagonal")


@needs_compiler
def test_weight_checks_are_redone_for_new_tensors():
    """The per-shard check cache never lets a changed shard through."""
    a = _args()
    cpu_ffn.sparse_ffn_bitmask(**a)
    with pytest.raises(ValueError, match="down_t.shape"):
        cpu_ffn.sparse_ffn_bitmask(**dict(a, down_t=torch.randn(20, 17)))
    cpu_ffn.sparse_ffn_bitmask(**a)



def _in_place(N_full: int, n: int, dtype, act: str, bias: bool, gen: torch.Generator):
    """Whole matrices [N_full, D] (a model file's) and a shard of n of their rows in no order
    (hottest first in the runtime): int32 row ids."""
    up, gate, down_t, b = make_shard(N_full, 64, dtype, act, bias, gen)
    rows = torch.randperm(N_full, generator=gen)[:n].to(torch.int32)
    return up, gate, down_t, (b.float() if b is not None else None), rows


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch-fallback"])
@pytest.mark.parametrize("act", ["relu", "reglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_read_a_shard_in_place_of_the_whole_matrices(compiled, act, dtype, monkeypatch):
    """rows: neuron j of the mask is row rows[j] of the whole matrices (and of up_bias): the same
    as the kernel over the gathered rows, against float64, with and without a mask, T = 1 to 70
    (two blocks of tokens), both splits; every row read is one of the shard's."""
    if compiled and not cpu_ffn.available():
        pytest.skip("no C++ compiler")
    if not compiled:
        monkeypatch.setattr(cpu_ffn, "library", lambda: None)
    gen = torch.Generator().manual_seed(zlib.crc32(f"rows{dtype}{act}{compiled}".encode()))
    up, gate, down_t, b, rows = _in_place(301, 117, dtype, act, act == "relu", gen)
    sel = rows.long()
    shard = (up[sel], None if gate is None else gate[sel], down_t[sel], None if b is None else b[sel])
    for T, density, split in ((1, 0.2, "auto"), (5, 0.1, "rows"), (5, 0.3, "cols"), (70, 0.05, "auto")):
        x = torch.randn(T, 64, generator=gen).to(dtype)
        mask = token_mask(T, 117, density, gen)
        what = f"{dtype} {act} T={T} split={split}"
        su, sg, sd, sb = shard
        check(x, su, sg, sd, mask, act, sb, torch.float32, what + " (gathered)", split=split)  # the reference path
        out, ref = poisoned((T, 64), torch.float32), reference(x, su, sg, sd, mask, act, sb)
        stats = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, pack(mask), 117, act, b, out, split=split, rows=rows)
        assert stats[:2] == ref[1:], what
        assert rel_err(out, ref[0]) < max(TOL[dtype], TOL[torch.float32]), what
    out = poisoned((2, 64), torch.float32)  # no mask: every one of the shard's rows
    x = torch.randn(2, 64, generator=gen).to(dtype)
    assert cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None, 117, act, b, out, rows=rows)[:2] == (2 * 117, 117)
    ref = reference(x, *shard[:3], torch.ones(2, 117, dtype=torch.bool), act, shard[3])[0]
    assert rel_err(out, ref) < max(TOL[dtype], TOL[torch.float32])


@needs_compiler
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_rows_of_quantized_matrices_equal_the_gathered_rows(qtype):
    """Quantized whole matrices with row ids give the gathered shard's result bit for bit on one
    thread (the same rows in the same order through the same code; that path is checked against
    gguf-py's dequantization in test_cpu_quant.py)."""
    from gguf import GGMLQuantizationType as GQ
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(len(qtype))
    N_full, n, D = 260, 90, 64
    up, gate, down_t = (torch.from_numpy(quantize(torch.randn(N_full, D, generator=gen).numpy(), GQ[qtype.upper()]))
                        for _ in range(3))
    rows = torch.randperm(N_full, generator=gen)[:n].to(torch.int32)
    sel = rows.long()
    for T in (1, 6):
        x = torch.randn(T, D, generator=gen)
        packed = pack(token_mask(T, n, 0.3, gen))
        a, b = torch.empty(T, D), torch.empty(T, D)
        sa = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, packed, n, "reglu", None, a, 1, qtype=qtype, rows=rows)
        sb = cpu_ffn.sparse_ffn_bitmask(x, up[sel], gate[sel], down_t[sel], packed, n, "reglu", None, b, 1, qtype=qtype)
        assert sa == sb and torch.equal(a, b), (qtype, T)  # one thread: the same sums in the same order


@pytest.mark.parametrize("rows, match", [
    (torch.tensor([0, 5, 20], dtype=torch.int32), r"rows is ids in \[0, 20\], expected ids in \[0, 20\)"),
    (torch.tensor([0, -1, 3], dtype=torch.int32), r"ids in \[-1, 3\]"),
    (torch.tensor([0, 1, 2]), "rows is torch.int64"),
    (torch.tensor([0, 1, 2, 3], dtype=torch.int32)[::2], "contiguous"),
])
def test_bad_rows_name_the_field(rows, match):
    gen = torch.Generator().manual_seed(3)
    up, gate, down_t, _ = make_shard(20, 16, torch.float32, "reglu", False, gen)
    with pytest.raises(ValueError, match=match):
        cpu_ffn.sparse_ffn_bitmask(torch.randn(1, 16), up, gate, down_t, None, 2, "reglu", None, torch.empty(1, 16),
                                   rows=rows)
    with pytest.raises(ValueError, match=r"n is 4, expected an int in \[0, 3\]"):
        cpu_ffn.sparse_ffn_bitmask(torch.randn(1, 16), up, gate, down_t, None, 4, "reglu", None, torch.empty(1, 16),
                                   rows=torch.tensor([0, 1, 2], dtype=torch.int32))


VARIANT_SCRIPT = r"""
import sys, numpy as np, torch
from powerinfer_ray.kernels import cpu_ffn, cpu_library
cpu_library.select_build(sys.argv[1].split())
g = torch.Generator().manual_seed(7)
n, D = 300, 520  # a tail past the vector blocks
up, gate, down_t = (torch.randn(n, D, generator=g).half() for _ in range(3))
for act, T, p in (("reglu", 1, 0.3), ("reglu", 8, 0.3), ("reglu", 8, 0.9), ("relu", 1, 0.3), ("relu", 8, 0.5)):
    x = torch.randn(T, D, generator=g).half()  # T = 8: rows for few tokens and for most of them
    active = torch.rand(T, n, generator=g) < p
    packed = np.packbits(active.numpy(), axis=1, bitorder="little")
    out = torch.empty(T, D)
    cpu_ffn.sparse_ffn_bitmask(x, up, gate if act == "reglu" else None, down_t, packed, n, act, None, out, 2)
    xd, ud, gd, dd = (t.double() for t in (x, up, gate, down_t))
    h = (torch.relu(xd @ gd.T) if act == "reglu" else 1.0) * (xd @ ud.T) * active.double()
    h = h if act == "reglu" else torch.relu(h)
    ref = h @ dd
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, (T, p, err)
print("ok")
"""


@needs_compiler
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx2 -mno-avx512f -mno-fma -mno-f16c"])
def test_kernel_variant_builds(flags):
    """cpu_library.select_build builds a variant (the AVX2 and the portable vector code) as the
    process's library; each agrees with the float64 reference."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", VARIANT_SCRIPT, flags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")


def test_select_build_refuses_a_second_build():
    from powerinfer_ray.kernels import cpu_library

    if cpu_library.library() is None:
        pytest.skip("no compiler")
    with pytest.raises(ValueError, match="select a build before the first kernel call"):
        cpu_library.select_build(["-mno-avx512f"])
    assert cpu_library.select_build([]) is cpu_library.library()


@pytest.mark.parametrize("wdt", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, R, D", [(1, 7, 100), (1, 130, 544), (3, 33, 77), (8, 64, 128), (70, 9, 33),
                                     (1, 1, 1), (2, 0, 16)])
def test_linear_matches_float64(wdt, T, R, D):
    """kernels.cpu_ffn.linear (the compiled dense rows kernel: pairs at T = 1, token blocks, 64
    tokens per call) against float64 on the same weights; output poisoned first."""
    from powerinfer_ray.kernels.cpu_ffn import linear

    gen = torch.Generator().manual_seed(T * 1000 + R)
    x = torch.randn(T, D, generator=gen)
    w = torch.randn(R, D, generator=gen).to(wdt)
    b = torch.randn(R, generator=gen).half()
    y = linear(x, w, b, threads=2)
    ref = x.double() @ w.double().T + b.double()
    assert y.shape == (T, R) and y.dtype == torch.float32
    if R:
        assert torch.isfinite(y).all()
        assert (y.double() - ref).abs().max() < 1e-5 * (1 + ref.abs().max())
    xs = x.reshape(1, T, D).to(wdt)  # leading dims kept, x converted
    assert torch.allclose(linear(xs, w, threads=2)[0].double(), xs[0].double() @ w.double().T, rtol=1e-5, atol=1e-4)


def test_linear_strided_weights_and_bad_shapes():
    from powerinfer_ray.kernels.cpu_ffn import linear

    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 24, generator=gen), torch.randn(24, 10, generator=gen).half()
    assert torch.allclose(linear(x, w.T), x @ w.float(), rtol=1e-5, atol=1e-5)  # columns strided: torch path
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., D\] and w \[R, D\]"):
        linear(x, w)
    with pytest.raises(ValueError, match="float32 / float16 / bfloat16"):
        linear(x, w.T.to(torch.int8))
