"""The CPU kernels on ggml Q4_0 / Q8_0 rows (csrc/quant.h) against float64, with gguf-py's own
quantizer as the independent reference of the formats.

Tolerance: the kernels multiply a Q8_0-quantized x as ggml does, so the reference takes the same
activation, quant.round_q8_0(x) (its bytes are checked against gguf-py below), times the exactly
dequantized weights in float64. What is left is fp32 accumulation: relative L2 error < 1e-5 for
fp32 outputs (TOL), the output rounding for fp16 / bf16 outputs. Against the unrounded x the
error is ~1e-2 (the activation's Q8_0 rounding), which the tests also check, so a kernel that
skipped ggml's activation quantization would fail them.
"""
from __future__ import annotations

import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from powerinfer_ray.kernels import cpu_ffn, cpu_library, quant, sparse_ffn, sparse_ffn_ref, token_bits

from kernel_checks import TOL, poisoned, rel_err

QTYPES = {"q4_0": GQ.Q4_0, "q8_0": GQ.Q8_0}
ACTS = ("relu", "reglu", "drelu", "swiglu")
needs_compiler = pytest.mark.skipif(not cpu_library.available(), reason="no C++ compiler: compiled kernel unavailable")


def quantized(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w [R, C] fp32 -> uint8 [R, C // 32 * block bytes], by gguf-py's quantizer."""
    return torch.from_numpy(gguf_quantize(w.float().numpy(), QTYPES[qtype]))


def q_shard(N: int, D: int, qtype: str, act: str, gen: torch.Generator):
    """up, gate (None for relu), down_t as quantized rows; pre-activations ~ N(0, 1)."""
    up = quantized(torch.randn(N, D, generator=gen) * D ** -0.5, qtype)
    gate = None if act == "relu" else quantized(torch.randn(N, D, generator=gen) * D ** -0.5, qtype)
    return up, gate, quantized(torch.randn(N, D, generator=gen), qtype)


def activations(T: int, D: int, gen: torch.Generator) -> torch.Tensor:
    """x [T, D] with blocks of very different magnitudes, exact zeros and a whole zero block."""
    x = torch.randn(T, D, generator=gen) * torch.exp(torch.randn(T, D // 32, 1, generator=gen)).repeat_interleave(
        32, 1).reshape(T, D)
    x[:, 5] = 0.0
    x[0, :32] = 0.0
    return x


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf(qtype):
    """quant.dequantize on gguf-py's blocks and on arbitrary bytes (every nibble, q = -128, f16
    scales of any exponent) equals gguf-py's dequantize."""
    gen = torch.Generator().manual_seed(1)
    bb = quant.BLOCK_BYTES[qtype]
    w = quantized(activations(6, 160, gen), qtype)
    raw = torch.randint(0, 256, (6, 5 * bb), generator=gen, dtype=torch.uint8)
    raw.view(6, 5, bb)[..., 1] &= 0x7B  # scales finite: exponent below 31
    for blocks in (w, raw):
        got = quant.dequantize(blocks, qtype)
        want = torch.from_numpy(gguf_dequantize(blocks.numpy(), QTYPES[qtype]))
        assert got.shape == (6, 160) and torch.equal(got, want)
    empty = quant.dequantize(w[:0], qtype, torch.float64)  # an empty gather (no active rows)
    assert empty.shape == (0, 160) and empty.dtype == torch.float64


@needs_compiler
def test_activation_quantizer_bytes_equal_gguf():
    """The Q8_0 quantizer of x, in torch (quant.quantize_q8_0) and in C++ (the kernels'), writes
    gguf-py's bytes, ties (|x| / d exactly k + 0.5) and all-zero blocks included."""
    gen = torch.Generator().manual_seed(2)
    x = activations(4, 256, gen)
    x[1, 32:64] = torch.arange(32) - 15.5  # d = 16.5 / 127: x / d hits .5 fractions exactly
    x[2, 64:96] = (torch.arange(32) % 5 - 2) * 0.25
    want = gguf_quantize(x.numpy(), GQ.Q8_0)
    assert np.array_equal(quant.quantize_q8_0(x).numpy(), want)
    got = np.zeros_like(want)
    assert cpu_library.library().pi_quantize_q8_0(x.data_ptr(), x.numel(), got.ctypes.data) == 0
    assert np.array_equal(got, want)
    assert torch.equal(quant.round_q8_0(x), torch.from_numpy(gguf_dequantize(want, GQ.Q8_0)).double())


def check_bitmask(x, up, gate, down_t, mask, act, qtype, out_dtype, what, **kw):
    T, D = x.shape
    out = poisoned((T, D), out_dtype)
    packed = np.packbits(mask.numpy(), axis=1, bitorder="little")
    pairs, rows, down_rows = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, packed, mask.shape[1], act, None, out,
                                                        qtype=qtype, **kw)
    idx = mask.any(0).nonzero().reshape(-1)
    assert (pairs, rows) == (int(mask.sum()), idx.numel()) and down_rows <= rows, what
    if idx.numel() == 0:
        assert torch.equal(out, torch.zeros_like(out)), what
        return
    ref = sparse_ffn_ref(quant.round_q8_0(x), up, gate, down_t, idx, mask[:, idx], act, qtype=qtype)
    tol = max(TOL[torch.float32], TOL[out_dtype])
    err = rel_err(out, ref)
    assert err < tol, f"{what}: rel err {err:.2e} >= {tol:.0e}"
    if out_dtype == torch.float32:  # (fp16 / bf16 outputs' own rounding is of the same order)
        unrounded = rel_err(out, sparse_ffn_ref(x, up, gate, down_t, idx, mask[:, idx], act, qtype=qtype))
        assert unrounded > 10 * err, f"{what}: the kernel multiplied x unrounded? ({unrounded:.2e} vs {err:.2e})"


@needs_compiler
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_bitmask_quantized_matches_reference(qtype, act):
    """The executor's entry on quantized rows: blocks per row even and odd (AVX-512 takes two per
    step), x and out in each float dtype, every token count class (1, register blocks, few tokens
    per row), densities from one bit to all."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{qtype}{act}".encode()))
    N = 90
    for D in (64, 96):
        up, gate, down_t = q_shard(N, D, qtype, act, gen)
        for T, density in ((1, 0.3), (2, 1.0), (5, 0.05), (8, 0.5), (17, 0.2)):
            xdt = (torch.float32, torch.float16, torch.bfloat16)[T % 3]
            x = activations(T, D, gen).to(xdt)
            out_dt = torch.float32 if T % 2 else xdt
            mask = torch.rand(T, N, generator=gen) < density
            check_bitmask(x, up, gate, down_t, mask, act, qtype, out_dt, f"{qtype} {act} D={D} T={T} x {xdt}")


@needs_compiler
@pytest.mark.parametrize("split", ["rows", "cols"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_splits_threads_and_dense_reads(qtype, split):
    """Either work split at 1-3 threads, few and many rows; the dense read (no mask, skip_zero
    off: the layer-offload baseline) reads every down row."""
    gen = torch.Generator().manual_seed(len(split) + len(qtype))
    N, D = 400, 128
    up, gate, down_t = q_shard(N, D, qtype, "reglu", gen)
    for threads in (1, 2, 3):
        for T, density in ((1, 0.01), (1, 0.5), (4, 0.3)):
            x = activations(T, D, gen)
            check_bitmask(x, up, gate, down_t, torch.rand(T, N, generator=gen) < density, "reglu", qtype,
                          torch.float32, f"{split} threads={threads} T={T} d={density}", threads=threads, split=split)
    x = activations(3, D, gen)
    out = poisoned((3, D), torch.float32)
    assert cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None, N, "reglu", None, out, 2, split=split,
                                      skip_zero=False, qtype=qtype) == (3 * N, N, N)
    ref = sparse_ffn_ref(quant.round_q8_0(x), up, gate, down_t, torch.arange(N), None, "reglu", qtype=qtype)
    assert rel_err(out, ref) < TOL[torch.float32]


@needs_compiler
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bits"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_sparse_ffn_dispatch_on_quantized_rows(qtype, mask_kind):
    """kernels.sparse_ffn with a qtype: the compiled kernel (idx entry, 70 tokens: two calls) and
    the torch path, with an up bias and a device count below len(idx)."""
    gen = torch.Generator().manual_seed(7 + len(mask_kind))
    N, D, K = 120, 96, 70
    up, gate, down_t = q_shard(N, D, qtype, "drelu", gen)
    b = torch.randn(N, generator=gen) * 0.5
    idx = torch.randperm(N, generator=gen)[:K]
    for T in (1, 6, 70):
        x = activations(T, D, gen).half()
        mask = None
        if mask_kind != "none" and not (mask_kind == "bits" and T > 32):
            mask = torch.rand(T, K, generator=gen) < 0.6
        if mask is not None and mask_kind == "bits":
            mask = token_bits(mask)
        n_act = torch.tensor([K - 9])
        for backend, xref, tol in (("cpu", quant.round_q8_0(x), TOL[torch.float16]), ("torch", x, TOL[torch.float16])):
            out = poisoned((T, D), torch.float16)
            y = sparse_ffn(x, up, gate, down_t, idx, mask, "drelu", b, out=out, n_active=n_act, backend=backend,
                           threads=2, qtype=qtype)
            err = rel_err(y, sparse_ffn_ref(xref, up, gate, down_t, idx, mask, "drelu", b, n_act, qtype=qtype))
            assert y is out and err < tol, f"{backend} T={T}: {err:.2e}"


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T, R, D", [(1, 7, 64), (1, 130, 544), (3, 33, 96), (70, 9, 32)])
def test_linear_quantized_matches_float64(qtype, T, R, D):
    """kernels.cpu_ffn.linear on quantized rows (attention heads, the predictor on the CPU):
    float64 over round_q8_0(x) and the dequantized rows; leading dims kept; bias added."""
    gen = torch.Generator().manual_seed(T * 1000 + R)
    x = activations(T, D, gen)
    w = quantized(torch.randn(R, D, generator=gen), qtype)
    b = torch.randn(R, generator=gen)
    y = cpu_ffn.linear(x.reshape(1, T, D), w, b, threads=2, qtype=qtype)
    ref = quant.round_q8_0(x) @ quant.dequantize(w, qtype, torch.float64).T + b.double()
    assert y.shape == (1, T, R) and y.dtype == torch.float32
    assert rel_err(y[0], ref) < TOL[torch.float32]


@pytest.mark.parametrize("qtype", QTYPES)
def test_fallback_without_compiler_on_quantized_rows(qtype, monkeypatch):
    """Without the compiled kernels: the torch path on the dequantized rows (x as it is), same
    counts, float64 values within fp32 rounding."""
    monkeypatch.setattr(cpu_ffn, "library", lambda: None)
    gen = torch.Generator().manual_seed(11)
    N, D, T = 40, 64, 3
    up, gate, down_t = q_shard(N, D, qtype, "swiglu", gen)
    x = activations(T, D, gen)
    mask = torch.rand(T, N, generator=gen) < 0.4
    out = poisoned((T, D), torch.float32)
    packed = np.packbits(mask.numpy(), axis=1, bitorder="little")
    idx = mask.any(0).nonzero().reshape(-1)
    assert cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, packed, N, "swiglu", None, out,
                                      qtype=qtype)[:2] == (int(mask.sum()), idx.numel())
    assert rel_err(out, sparse_ffn_ref(x, up, gate, down_t, idx, mask[:, idx], "swiglu", qtype=qtype)) < 1e-5
    y = cpu_ffn.linear(x, up, qtype=qtype)
    assert rel_err(y, x.double() @ quant.dequantize(up, qtype, torch.float64).T) < 1e-5


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
def test_predictor_on_quantized_rows(qtype):
    """predictor_logits with quantized fc1 [r, D] and fc2 [N, r] (upstream's Q4_0 files quantize
    both) through kernels.linear on the CPU: each GEMV quantizes its input to Q8_0, so the float64
    reference rounds x and z = relu(fc1 . x) the same way. Tolerance 1e-4 rather than 1e-5: z
    comes out of fp32 sums, and an element within ~1e-7 of a rounding boundary may round the other
    way (one step of 1/127 of its block's largest value)."""
    from powerinfer_ray.kernels import linear_ref, predictor_logits

    gen = torch.Generator().manual_seed(4)
    D, r, N = 256, 128, 300
    fc1 = quantized(torch.randn(r, D, generator=gen) * D ** -0.5, qtype)
    fc2 = quantized(torch.randn(N, r, generator=gen), qtype)
    for T in (1, 5):
        x = activations(T, D, gen)
        z = torch.relu(linear_ref(quant.round_q8_0(x), fc1, qtype=qtype))
        ref = linear_ref(quant.round_q8_0(z), fc2, qtype=qtype)
        got = predictor_logits(x, fc1, fc2, qtype)
        assert got.shape == (T, N) and got.dtype == x.dtype and rel_err(got, ref) < 1e-4, (T, rel_err(got, ref))


def test_quantized_weights_bad_arguments_name_the_field():
    gen = torch.Generator().manual_seed(3)
    up, gate, down_t = q_shard(20, 64, "q4_0", "reglu", gen)
    x, out, packed = torch.randn(2, 64), torch.zeros(2, 64), np.zeros((2, 3), np.uint8)
    with pytest.raises(ValueError, match="qtype is 'q5_0'"):
        cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, packed, 20, "reglu", None, out, qtype="q5_0")
    with pytest.raises(ValueError, match=r"up is torch.float32 \(20, 36\), expected uint8"):
        cpu_ffn.sparse_ffn_bitmask(x, up.float(), gate, down_t, packed, 20, "reglu", None, out, qtype="q4_0")
    with pytest.raises(ValueError, match="down_t.shape"):
        cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t[:, :18], packed, 20, "reglu", None, out, qtype="q4_0")
    with pytest.raises(ValueError, match="uint8 blocks need a qtype"):
        cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, packed, 20, "reglu", None, out)
    with pytest.raises(ValueError, match=r"x.shape is \(2, 32\), expected \[T, 64\]"):
        cpu_ffn.sparse_ffn_bitmask(x[:, :32], up, gate, down_t, packed, 20, "reglu", None, out[:, :32], qtype="q4_0")
    with pytest.raises(ValueError, match="a multiple of 32"):
        sparse_ffn(torch.randn(1, 40), up, gate, down_t, torch.arange(3), qtype="q4_0")
    with pytest.raises(ValueError, match=r"w.shape is \(20, 36\), expected uint8 \[R, 72\]"):
        cpu_ffn.linear(torch.randn(1, 128), up[:, :36], qtype="q4_0")


VARIANT_SCRIPT = r"""
import sys, numpy as np, torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import quantize
from powerinfer_ray.kernels import cpu_ffn, cpu_library, quant, sparse_ffn_ref
lib = cpu_library.select_build(sys.argv[1].split())
print("isa", lib.pi_quant_isa(), "lanes", lib.pi_simd_width())
g = torch.Generator().manual_seed(5)
def q(w, t):
    return torch.from_numpy(quantize(w.numpy(), {"q4_0": GQ.Q4_0, "q8_0": GQ.Q8_0}[t]))
x = torch.randn(9, 96, generator=g) * 3
blocks = np.zeros((9, 3 * 34), np.uint8)
lib.pi_quantize_q8_0(x.data_ptr(), x.numel(), blocks.ctypes.data)
assert np.array_equal(blocks, quantize(x.numpy(), GQ.Q8_0)), "activation quantizer"
worst = 0.0
for qt in ("q4_0", "q8_0"):
    for D in (96, 128, 1056):  # 1056: the activation quantized in pieces of 1024 columns, the last of one block
        up, gate, down = (q(torch.randn(70, D, generator=g) * D ** -0.5, qt) for _ in range(3))
        for T, act, split in ((1, "reglu", "cols"), (1, "relu", "rows"), (3, "swiglu", "rows"), (9, "reglu", "cols")):
            x = torch.randn(T, D, generator=g).half()
            mask = torch.rand(T, 70, generator=g) < 0.4
            out = torch.full((T, D), float("nan"))
            gt = gate if act != "relu" else None
            cpu_ffn.sparse_ffn_bitmask(x, up, gt, down, np.packbits(mask.numpy(), axis=1, bitorder="little"), 70,
                                       act, None, out, 2, split=split, qtype=qt)
            idx = mask.any(0).nonzero().reshape(-1)
            ref = sparse_ffn_ref(quant.round_q8_0(x), up, gt, down, idx, mask[:, idx], act, qtype=qt)
            assert torch.isfinite(out).all(), (qt, D, T, act, split)  # (max() would pass a NaN error by)
            worst = max(worst, float((out.double() - ref).norm() / ref.norm()))
        y = cpu_ffn.linear(x.float(), up, qtype=qt, threads=2)
        ref = quant.round_q8_0(x) @ quant.dequantize(up, qt, torch.float64).T
        assert torch.isfinite(y).all(), (qt, D, "linear")
        worst = max(worst, float((y.double() - ref).norm() / ref.norm()))
print("worst", worst)
assert worst < 1e-5, worst
"""


@needs_compiler
@pytest.mark.parametrize("cflags, isa", [
    ("", None),  # the default build: whatever the CPU has
    ("-mno-avx512vnni", 512),  # AVX-512BW without VNNI: maddubs + madd
    ("-mno-avx512f", 256),  # AVX2
    ("-mno-avx2 -mno-avx512f -mno-fma -mno-f16c", 0),  # the scalar path, on any x86 machine
])
def test_every_vector_path_of_the_quantized_dots(cflags, isa):
    """Each compile-time path of csrc/quant.h (chosen by flags below the CPU's own, so every one this
    CPU can run is reached) against float64, and its activation quantizer against gguf-py's bytes."""
    native = cpu_library.library().pi_quant_isa()
    if isa is not None and isa > native:
        pytest.skip(f"this CPU's build reaches quant ISA {native}, not {isa}")
    proc = subprocess.run([sys.executable, "-c", VARIANT_SCRIPT, cflags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = int(proc.stdout.split()[1])
    assert got == (native if isa is None else isa), proc.stdout
