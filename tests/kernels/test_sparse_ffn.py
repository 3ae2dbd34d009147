"""sparse_ffn on the CPU (compiled kernel and torch path) against the float64 reference."""
from __future__ import annotations

import zlib

import pytest
import torch

from powerinfer_ray.kernels import bits_to_mask, sparse_ffn, sparse_ffn_ref, token_bits
from powerinfer_ray.kernels import cpu_ffn
from powerinfer_ray.kernels.quant import dequantize
from powerinfer_ray.model.reference import ffn_activation, threshold_criterion

from kernel_checks import (DENSITIES, DTYPES, TOL, make_idx, make_shard, n_active, poisoned, rel_err, swiglu_case,
                           swiglu_oracle)

ACTS = ("relu", "reglu", "drelu", "swiglu")
needs_compiler = pytest.mark.skipif(not cpu_ffn.available(), reason="no C++ compiler: compiled kernel unavailable")


def _backends(gemm: bool = True):
    """The backends a CPU test runs: the compiled kernel, torch, and (gemm) the matrix multiplies a
    CUDA call of many tokens takes, which run on any device."""
    return [pytest.param("cpu", marks=needs_compiler), "torch"] + (["gemm"] if gemm else [])


def _check_case(backend, dtype, act, N, D, T, density, mask_kind, bias, gen, threads=None):
    up, gate, down_t, up_bias = make_shard(N, D, dtype, act, bias, gen)
    K = n_active(density, N)
    idx = make_idx(K, N, gen, dtype=torch.int32 if K % 2 else torch.int64)
    x = torch.randn(T, D, generator=gen).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(T, K, generator=gen) < 0.7  # [T, K]
    elif mask_kind == "bits":
        mask = token_bits(torch.rand(T, K, generator=gen) < 0.7)  # [K] int32
    out = poisoned((T, D), dtype)
    y = sparse_ffn(x, up, gate, down_t, idx, mask, act, up_bias, out=out, backend=backend, threads=threads)
    ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, up_bias)  # [T, D] float64
    assert y is out and y.dtype == dtype
    if K == 0:
        assert torch.equal(y, torch.zeros_like(y)), "K = 0 must give zeros"
        return
    err = rel_err(y, ref)
    assert err < TOL[dtype], (f"{backend} {dtype} act={act} N={N} D={D} T={T} K={K} mask={mask_kind} "
                              f"bias={bias}: rel err {err:.2e} >= {TOL[dtype]:.0e}")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_over_densities_and_tokens(backend, dtype, act):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{backend}{dtype}{act}".encode()))
    N, D = 256, 100  # D not a multiple of the SIMD width: exercises the scalar tails
    for density in DENSITIES:
        for T in (1, 3, 8, 32):
            mask_kind = ("none", "bool", "bits")[T % 3]
            _check_case(backend, dtype, act, N, D, T, density, mask_kind, bias=(T % 2 == 1), gen=gen)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bits"])
@pytest.mark.parametrize("bias", [False, True])
def test_masks_and_bias_at_realistic_width(backend, mask_kind, bias):
    gen = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        for T in (1, 5, 17):
            _check_case(backend, dtype, "reglu", 512, 1024, T, 0.1, mask_kind, bias, gen)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_do_not_change_the_result_beyond_rounding(threads):
    gen = torch.Generator().manual_seed(3)
    _check_case("cpu", torch.float32, "drelu", 300, 257, 9, 0.5, "bool", True, gen, threads=threads)


@needs_compiler
def test_many_tokens_are_split_into_kernel_calls():
    gen = torch.Generator().manual_seed(4)
    _check_case("cpu", torch.float16, "reglu", 128, 64, 70, 0.5, "bool", False, gen)


def test_full_density_equals_the_dense_ffn():
    gen = torch.Generator().manual_seed(5)
    N, D, T = 96, 48, 4
    up, gate, down_t, _ = make_shard(N, D, torch.float32, "reglu", False, gen)
    x = torch.randn(T, D, generator=gen)
    dense = (torch.relu(x @ gate.T) * (x @ up.T)) @ down_t  # [T, D]
    y = sparse_ffn(x, up, gate, down_t, torch.arange(N))
    assert rel_err(y, dense) < 1e-5


def test_disjoint_neuron_sets_add_up_to_the_full_output():
    gen = torch.Generator().manual_seed(6)
    N, D, T = 200, 64, 3
    up, gate, down_t, b = make_shard(N, D, torch.float32, "swiglu", True, gen)
    x = torch.randn(T, D, generator=gen)
    perm = torch.randperm(N, generator=gen)
    parts = [sparse_ffn(x, up, gate, down_t, perm[i::3], act="swiglu", up_bias=b) for i in range(3)]
    full = sparse_ffn_ref(x, up, gate, down_t, torch.arange(N), act="swiglu", up_bias=b)
    assert rel_err(sum(parts), full) < 1e-5


def test_shard_rows_with_local_ids_equal_global_rows():
    gen = torch.Generator().manual_seed(8)
    N, D = 120, 40
    up, gate, down_t, _ = make_shard(N, D, torch.float16, "drelu", False, gen)
    rows = torch.randperm(N, generator=gen)[:50].sort().values  # the shard's global rows
    x = torch.randn(2, D, generator=gen).half()
    local = torch.tensor([0, 7, 49, 20])
    y_shard = sparse_ffn(x, up[rows], gate[rows], down_t[rows], local, act="drelu")
    y_full = sparse_ffn(x, up, gate, down_t, rows[local], act="drelu")
    assert rel_err(y_shard, y_full) < 1e-3


@pytest.mark.parametrize("backend", _backends(gemm=False))
def test_n_active_uses_only_the_first_entries(backend):
    gen = torch.Generator().manual_seed(9)
    N, D, T = 64, 32, 4
    up, gate, down_t, _ = make_shard(N, D, torch.float32, "reglu", False, gen)
    x = torch.randn(T, D, generator=gen)
    idx = make_idx(40, N, gen)
    bits = token_bits(torch.rand(T, 40, generator=gen) < 0.5)
    for n in (0, 1, 17, 40):
        y = sparse_ffn(x, up, gate, down_t, idx, bits, n_active=torch.tensor([n], dtype=torch.int32), backend=backend)
        ref = sparse_ffn_ref(x, up, gate, down_t, idx[:n], bits[:n])
        assert rel_err(y, ref) < 1e-5 if n else torch.equal(y, torch.zeros_like(y))


def test_bits_and_bool_masks_agree():
    gen = torch.Generator().manual_seed(10)
    active = torch.rand(32, 50, generator=gen) < 0.5
    active[31, :3] = True  # bit 31 is the int32 sign bit
    bits = token_bits(active)
    assert bits.dtype == torch.int32
    assert torch.equal(bits_to_mask(bits, 32), active)


@needs_compiler
def test_out_of_range_idx_raises():
    up = torch.randn(10, 8)
    with pytest.raises(IndexError, match="idx\\[1\\] = 10"):
        sparse_ffn(torch.randn(1, 8), up, up, up, torch.tensor([3, 10]), backend="cpu")
    with pytest.raises(IndexError):
        sparse_ffn(torch.randn(1, 8), up, up, up, torch.tensor([-1]), backend="cpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(act="gelu"), "act"),
    (dict(gate=None), "gate"),
    (dict(mask=torch.ones(2, 3, dtype=torch.bool)), "mask.shape"),
    (dict(up_bias=torch.zeros(5)), "up_bias.shape"),
    (dict(out=torch.zeros(1, 8, dtype=torch.float16)), "out"),
    (dict(idx=torch.tensor([0.5])), "idx"),
    (dict(backend="triton"), "CUDA tensors"),
    (dict(backend="gpu"), "backend"),
    (dict(act="reglu", act_threshold=0.1), "act"),  # the SwiGLU options
    (dict(act="swiglu", act_threshold=-1.0), "act_threshold"),
    (dict(act="swiglu", act_threshold=0.1, act_on="u"), "act_on"),
    (dict(act="swiglu", gate_pre=torch.zeros(1, 10, dtype=torch.float16)), "gate_pre"),
    (dict(act="swiglu", gate_pre=torch.zeros(2, 10)), "gate_pre"),
    (dict(act="swiglu", gate_pre=torch.zeros(1, 10), backend="cpu"), "gate_pre"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    up = torch.randn(10, 8)
    args = dict(x=torch.randn(1, 8), up=up, gate=up, down_t=up, idx=torch.tensor([1, 2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sparse_ffn(**args)


@needs_compiler
def test_strided_rows_are_read_in_place():
    """A shard that is a row-slice view of a bigger matrix (row stride > D) needs no copy."""
    gen = torch.Generator().manual_seed(11)
    big = torch.randn(64, 96, generator=gen)
    up, gate, down_t = big[:, :32], big[:, 32:64], big[:, 64:]  # row stride 96
    x = torch.randn(3, 32, generator=gen)
    idx = make_idx(20, 64, gen)
    y = sparse_ffn(x, up, gate, down_t, idx, backend="cpu")
    assert rel_err(y, sparse_ffn_ref(x, up, gate, down_t, idx)) < 1e-5


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("on", ["gate", "h"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_threshold_matches_the_models_thresholded_ffn(backend, on, dtype):
    """act_threshold zeroes h where |SiLU(g)| (or |h|) is not above t: against the model's own
    thresholded FFN (model.reference) over the same rows, at T = 1 and a few tokens, over every
    row (gate-first) and a predicted subset with a mask (predicted mode); and the reference's
    threshold option equals it too."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{backend}{on}{dtype}".encode()))
    N, D = 256, 100
    for T in (1, 5):
        x, up, gate, down_t, t = swiglu_case(N, D, T, dtype, on, gen)
        for idx, mask in ((torch.arange(N), None), (make_idx(90, N, gen), torch.rand(T, 90, generator=gen) < 0.8)):
            y = sparse_ffn(x, up, gate, down_t, idx, mask, "swiglu", backend=backend, act_threshold=t, act_on=on)
            want = swiglu_oracle(x, up, gate, down_t, idx, t, on, mask)
            assert rel_err(y, want) < TOL[dtype], (T, mask is not None)
            ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, "swiglu", act_threshold=t, act_on=on)
            assert rel_err(ref, want) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_precomputed_gate_values_replace_the_gate_rows(dtype):
    """gate_pre [T, N]: the kernel takes g from it and never reads the gate rows (gate=None): the
    same output as with the rows, threshold included."""
    gen = torch.Generator().manual_seed(12)
    N, D, T = 128, 64, 3
    x, up, gate, down_t, t = swiglu_case(N, D, T, dtype, "gate", gen)
    g = (x.float() @ gate.float().T).contiguous()  # [T, N] fp32
    idx = make_idx(70, N, gen)
    bits = token_bits(torch.rand(T, 70, generator=gen) < 0.7)
    y = sparse_ffn(x, up, None, down_t, idx, bits, "swiglu", gate_pre=g, act_threshold=t)
    want = sparse_ffn_ref(x, up, gate, down_t, idx, bits, "swiglu", act_threshold=t)
    assert rel_err(y, want) < TOL[dtype]


@pytest.mark.parametrize("qtype", [None, "q4_0", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gemm_path_reads_rows_in_chunks_and_counts_active_rows(qtype, dtype):
    """sparse_ffn_gemm (the path of a CUDA call of many tokens) in its smallest chunks, so the
    chunk edges fall inside idx: a subset of rows in random order with a bool mask (and every row,
    idx None, under a mask over all), OPT's up bias and the SwiGLU threshold, against float64; count adds each row's tokens with h != 0, which
    for every row and no mask is the shard's true activity."""
    from powerinfer_ray.kernels.torch_ffn import sparse_ffn_gemm

    from test_cpu_quant import q_shard

    gen = torch.Generator().manual_seed(zlib.crc32(f"{qtype}{dtype}".encode()))
    N, D, T = 96, 64, 40
    for act in ("relu", "swiglu"):
        if qtype is None:
            up, gate, down_t, bias = make_shard(N, D, dtype, act, act == "relu", gen)
        else:
            (up, gate, down_t), bias = q_shard(N, D, qtype, act, gen), None
        x = torch.randn(T, D, generator=gen).to(dtype)
        t = 0.05 if act == "swiglu" else None
        idx = make_idx(70, N, gen)
        mask = torch.rand(T, 70, generator=gen) < 0.6
        count = torch.zeros(N, dtype=torch.int64)
        y = sparse_ffn_gemm(x, up, gate, down_t, idx, mask, act, bias, poisoned((T, D), dtype), qtype,
                            act_threshold=t, count=count, chunk_bytes=1)  # chunks of 64 rows
        ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, bias, qtype=qtype, act_threshold=t)
        assert rel_err(y, ref) < TOL[dtype], (act, rel_err(y, ref))
        assert count.sum() <= int(mask.sum()) and not count[torch.ones(N, dtype=torch.bool).index_fill_(
            0, idx, False)].any(), "rows outside idx counted"
        full = torch.rand(T, N, generator=gen) < 0.6  # idx None: the mask is over every row
        y = sparse_ffn_gemm(x, up, gate, down_t, None, full, act, bias, None, qtype, act_threshold=t, chunk_bytes=1)
        ref = sparse_ffn_ref(x, up, gate, down_t, torch.arange(N), full, act, bias, qtype=qtype, act_threshold=t)
        assert rel_err(y, ref) < TOL[dtype], (act, "every row", rel_err(y, ref))
        every = torch.zeros(N, dtype=torch.int64)
        sparse_ffn_gemm(x, up, gate, down_t, None, None, act, bias, None, qtype, act_threshold=t, count=every)
        w = (lambda m: m.double()) if qtype is None else (lambda m: dequantize(m, qtype, torch.float64))
        u = x.double() @ w(up).T + (0 if bias is None else bias.double())
        g = None if gate is None else x.double() @ w(gate).T
        h = ffn_activation(act, u, g)
        active = h != 0 if t is None else threshold_criterion("gate", g, h) > t
        # rows whose activity differs only by the compute dtype's rounding of a value near zero
        assert (every != active.sum(0)).sum() <= (1 if dtype == torch.float16 else 0), (every, active.sum(0))
