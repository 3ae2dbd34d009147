"""The kernels on a CUDA device: Triton sparse FFN (float and ggml Q4_0 / Q8_0 rows) and split,
the quantized GEMV and predictor, attention, CUDA-graph capture."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_checks import DENSITIES, make_idx, make_shard, n_active, poisoned, rel_err  # noqa: E402

from powerinfer_ray.kernels import (head_attention, head_attention_ref, local_index, packed_views,  # noqa: E402
                                    sparse_ffn, sparse_ffn_ref, split_active, split_active_packed, token_bits,
                                    unpack_active)

# fp32 weights go through tf32x3 dots (T > 1); fp16 / bf16 outputs are rounded once.
GPU_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
DEV = "cuda"


def _check_ffn(dtype, act, Ts, gen):
    """Every density and a mask form cycling with it (each Triton specialisation compiles once,
    so the combinations are spread rather than multiplied)."""
    N, D = 1024, 640
    up, gate, down_t, b = make_shard(N, D, dtype, act, act == "relu", gen, DEV)
    for i, density in enumerate(DENSITIES):
        K = n_active(density, N)
        for T in Ts:
            x = torch.randn(T, D, generator=gen).to(dtype).to(DEV)
            idx = make_idx(K, N, gen, torch.int32 if T % 2 else torch.int64, DEV)
            kind = i % 3
            mask = None if kind == 0 else (torch.rand(T, K, generator=gen) < 0.6).to(DEV)
            if kind == 2:
                mask = token_bits(mask)
            out = poisoned((T, D), dtype, DEV)
            y = sparse_ffn(x, up, gate, down_t, idx, mask, act, b, out=out)
            ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, b)
            if K == 0:
                assert torch.equal(y, torch.zeros_like(y))
                continue
            err = rel_err(y, ref)
            assert err < GPU_TOL[dtype], f"{dtype} {act} T={T} K={K} mask kind {kind}: rel err {err:.2e}"


@pytest.mark.parametrize("act", ["relu", "reglu", "drelu", "swiglu"])
def test_triton_sparse_ffn_every_activation_fp16(act):
    _check_ffn(torch.float16, act, (1, 8), torch.Generator().manual_seed(len(act)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_sparse_ffn_other_dtypes_and_token_counts(dtype):
    _check_ffn(dtype, "reglu", (1, 2, 17, 32), torch.Generator().manual_seed(2))


@pytest.mark.parametrize("T", [1, 8, 64, 256])
def test_triton_at_llama13b_shape(T):
    """At the 13B shape; 64 and 256 tokens (prompt chunks) through both paths: the matrix
    multiplies sparse_ffn picks for them and the Triton kernels in blocks of MAX_T tokens."""
    gen = torch.Generator().manual_seed(T)
    N, D = 13824, 5120
    up, gate, down_t, _ = make_shard(N, D, torch.float16, "reglu", False, gen, DEV)
    x = torch.randn(T, D, generator=gen).half().to(DEV)
    idx = make_idx(N // 10, N, gen, torch.int32, DEV)
    mask = (torch.rand(T, idx.numel(), generator=gen) < 0.5).to(DEV)
    ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask)
    for backend in ("auto", "triton") if T > 32 else ("auto",):
        y = sparse_ffn(x, up, gate, down_t, idx, mask, out=poisoned((T, D), torch.float16, DEV), backend=backend)
        assert rel_err(y, ref) < GPU_TOL[torch.float16], backend


def test_sparse_ffn_with_packed_inputs_replays_in_a_cuda_graph():
    """predictor logits -> packed split -> sparse_ffn with the count on the device: no host sync,
    so the whole chain is captured once and replayed for new logits."""
    gen = torch.Generator().manual_seed(1)
    N, D, T = 2048, 512, 4
    up, gate, down_t, _ = make_shard(N, D, torch.float16, "reglu", False, gen, DEV)
    x = torch.randn(T, D, generator=gen).half().to(DEV)
    gpu = (torch.rand(N, generator=gen) < 0.5).to(DEV)
    rows = gpu.nonzero().squeeze(1)
    shard = [w[rows].contiguous() for w in (up, gate, down_t)]
    loc = local_index(gpu)
    logits = torch.randn(T, N, generator=gen).half().to(DEV) - 1.0
    y = torch.empty(T, D, dtype=torch.float16, device=DEV)

    def step():
        packed = split_active_packed(logits, 0.0, gpu, local_of=loc, gpu_capacity=len(rows), cpu_capacity=N - len(rows))
        idx, bits, count = packed_views(packed.gpu)
        sparse_ffn(x, *shard, idx, bits, out=y, n_active=count)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        logits.copy_(torch.randn(T, N, generator=gen).half().to(DEV) - 1.0)
        graph.replay()
        torch.cuda.synchronize()
        active = (logits.float() >= 0.0) & gpu[None, :]  # [T, N]
        ref = sparse_ffn_ref(x, up, gate, down_t, torch.arange(N, device=DEV), active)
        assert rel_err(y, ref) < GPU_TOL[torch.float16]


@pytest.mark.parametrize("T", [1, 8, 32])
def test_triton_split_equals_exact_split(T):
    gen = torch.Generator().manual_seed(T)
    N = 13824
    logits = (torch.randn(T, N, generator=gen) - 1.5).half().to(DEV)
    gpu = (torch.rand(N, generator=gen) < 0.3).to(DEV)
    ng = int(gpu.sum())
    for loc in (None, local_index(gpu)):
        exact = split_active(logits, 0.0, gpu, loc)
        for backend in ("triton", "torch"):
            packed = split_active_packed(logits, 0.0, gpu, local_of=loc, gpu_capacity=ng, cpu_capacity=N - ng,
                                         backend=backend)
            for part, (idx, tok) in zip(packed, [(exact.gpu_idx, exact.gpu_tok_mask), (exact.cpu_idx, exact.cpu_tok_mask)]):
                got_idx, got_tok = unpack_active(part.cpu(), T)
                assert torch.equal(got_idx, idx.cpu()) and torch.equal(got_tok, tok.cpu()), backend


@pytest.mark.parametrize("T", [1, 8, 32])
def test_triton_split_adds_the_decode_counters(T):
    """The split's in-place counters (each neuron's active tokens, the GPU part's pairs and rows)
    equal torch's counts of the same threshold."""
    gen = torch.Generator().manual_seed(40 + T)
    N = 13824
    logits = (torch.randn(T, N, generator=gen) - 1.5).half().to(DEV)
    gpu = (torch.rand(N, generator=gen) < 0.6).to(DEV)
    ng = int(gpu.sum())
    act0 = torch.randint(0, 100, (N,), generator=gen).to(DEV)
    act, stats = act0.clone(), torch.tensor([3, 4], device=DEV)
    packed = split_active_packed(logits, 0.0, gpu, gpu_capacity=ng, cpu_capacity=0, backend="triton",
                                 activity=act, stats=stats)
    active = logits.float() >= 0.0
    assert torch.equal(act, act0 + active.sum(0))
    rows = int((active.any(0) & gpu).sum())
    assert stats.tolist() == [3 + int(active[:, gpu].sum()), 4 + rows]
    assert int(packed.gpu[0]) == rows


@pytest.mark.parametrize("B", [1, 4])
def test_rms_norm_cast_on_gpu_matches_float64(B):
    from powerinfer_ray.kernels.norm import rms_norm_cast, rms_norm_ref

    gen = torch.Generator().manual_seed(B)
    x, w = (torch.randn(B, 5120, generator=gen) * 4).to(DEV), (torch.rand(5120, generator=gen) + 0.5).to(DEV)
    y = rms_norm_cast(x, w, 1e-5, torch.float16)
    assert y.dtype == torch.float16 and rel_err(y, rms_norm_ref(x, w, 1e-5)) < GPU_TOL[torch.float16]


@pytest.mark.parametrize("style, Gs", [("norm", 40), ("neox", 8), (None, 8)])
def test_rope_cache_on_gpu_equals_the_torch_steps(style, Gs):
    """The fused rotary + KV-cache write at the 13B's head shape (hd 128) and a GQA shape."""
    from powerinfer_ray.kernels.attention import _rope_cache_torch, rope_table
    from powerinfer_ray.kernels.triton_attention import rope_cache_triton

    gen = torch.Generator().manual_seed(7)
    B, Hs, hd, S, L = 2, 40, 128, 3, 64
    qkv = torch.randn(B, (Hs + 2 * Gs) * hd, generator=gen).half().to(DEV)
    slots, pos = torch.tensor([2, 0], device=DEV), torch.tensor([9, 63], device=DEV)
    cos_t, sin_t = rope_table(L, hd, 10000.0, DEV)
    cos, sin = (cos_t[pos], sin_t[pos]) if style else (None, None)
    k0, v0 = (torch.randn(S, Gs, L, hd, generator=gen).half().to(DEV) for _ in range(2))
    want_k, want_v = k0.clone(), v0.clone()
    want_q = _rope_cache_torch(qkv.view(B, Hs + 2 * Gs, hd), cos, sin, style, hd, want_k, want_v, slots, pos, Hs)
    k, v = k0.clone(), v0.clone()
    q = rope_cache_triton(qkv, cos, sin, style, hd, k, v, slots, pos, Hs, Gs)
    assert rel_err(q, want_q) < GPU_TOL[torch.float16]
    assert rel_err(k, want_k) < GPU_TOL[torch.float16] and torch.equal(v, want_v)


@pytest.mark.parametrize("H, G", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("style", ["norm", "neox"])
def test_head_attention_on_gpu_matches_reference(H, G, style):
    gen = torch.Generator().manual_seed(H + G)
    B, T, D, hd, S = 3, 5, 256, 32, 64
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).half().to(DEV)  # noqa: E731
    w = dict(wq=r(H * hd, D, scale=D ** -0.5), wk=r(G * hd, D, scale=D ** -0.5), wv=r(G * hd, D, scale=D ** -0.5),
             wo_t=r(H * hd, D, scale=(H * hd) ** -0.5))
    x = r(B, T, D)
    kc, vc = r(4, G, S, hd), r(4, G, S, hd)
    rk, rv = kc.clone(), vc.clone()
    args = dict(slots=[3, 0, 1], start_pos=[10, 0, 40], rope_theta=10000.0, rope_style=style)
    y = head_attention(x, k_cache=kc, v_cache=vc, **args, **w)
    ref = head_attention_ref(x, k_cache=rk, v_cache=rv, **args, **w)
    assert rel_err(y, ref) < 5e-3
    assert rel_err(kc, rk) < 5e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_elementwise_kernels_at_one_token(dtype):
    """The non-dot T == 1 kernels (a Config option the sweep compares) against the reference."""
    from powerinfer_ray.kernels import triton_ffn

    cfg = triton_ffn.Config(8, 512, 4, 64, 64, 4, up_dot=False, down_dot=False)
    gen = torch.Generator().manual_seed(3)
    N, D = 1024, 640
    up, gate, down_t, _ = make_shard(N, D, dtype, "reglu", False, gen, DEV)
    x = torch.randn(1, D, generator=gen).to(dtype).to(DEV)
    for K in (1, 100, 1024):
        idx = make_idx(K, N, gen, torch.int32, DEV)
        for mask in (None, (torch.rand(1, K, generator=gen) < 0.5).to(DEV)):
            out = poisoned((1, D), dtype, DEV)
            y = triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, "reglu", None, out, None, cfg)
            assert rel_err(y, sparse_ffn_ref(x, up, gate, down_t, idx, mask)) < GPU_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H, G", [(40, 40), (64, 8)], ids=["13b", "70b"])
def test_triton_decode_attention_at_real_shapes(dtype, H, G):
    """hd = 128, keys 0..pos[b] of slot slots[b], against the float64 softmax."""
    import math

    from powerinfer_ray.kernels import decode_attention

    gen = torch.Generator(device="cuda").manual_seed(H)
    hd, S, n_slots = 128, 600, 4
    kc = torch.randn(n_slots, G, S, hd, generator=gen, device="cuda").to(dtype)
    vc = torch.randn(n_slots, G, S, hd, generator=gen, device="cuda").to(dtype)
    q = torch.randn(3, H, hd, generator=gen, device="cuda").to(dtype)
    slots, pos = torch.tensor([3, 0, 1], device="cuda"), torch.tensor([0, 63, 517], device="cuda")
    o = decode_attention(q, kc, vc, slots, pos, 1.0 / math.sqrt(hd))
    for b in range(3):
        k = kc[slots[b], :, : pos[b] + 1].double()  # [G, n, hd]
        v = vc[slots[b], :, : pos[b] + 1].double()
        qg = q[b].double().view(G, H // G, hd)
        p = torch.softmax(qg @ k.transpose(1, 2) / math.sqrt(hd), -1)  # [G, n_gqa, n]
        want = (p @ v).reshape(H, hd)
        err = float((o[b].double() - want).abs().max() / want.abs().max())
        assert err < (1e-2 if dtype == torch.float16 else 3e-2), (b, err)


@pytest.mark.parametrize("T", [1, 4, 32])
def test_pack_active_bits_on_gpu_equals_torch(T):
    from powerinfer_ray.kernels.predictor import pack_active_bits

    logits = torch.randn(T, 13824, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).half()
    got = pack_active_bits(logits, 0.5, 5000, 8824)
    assert torch.equal(got, pack_active_bits(logits, 0.5, 5000, 8824, backend="torch"))


def test_triton_fused_at_llama13b_shape_and_in_a_graph():
    """The fused variant (Config.fused_r, T == 1: one launch, atomics into an fp32 scratch the last
    program casts and zeroes) at the 13B shape against float64 for the sweep's kinds of configs
    (one block per program, several, lazy down rows), many calls back to back (a missed atomic
    shows as an error), a packed mask with the device count, then replayed from a CUDA graph for
    new inputs (the scratch must come back zero after every replay)."""
    from powerinfer_ray.kernels import triton_ffn, triton_fused

    gen = torch.Generator().manual_seed(12)
    N, D = 13824, 5120
    up, gate, down_t, _ = make_shard(N, D, torch.float16, "reglu", False, gen, DEV)
    idx = make_idx(N // 10, N, gen, torch.int32, DEV)
    x = torch.randn(1, D, generator=gen).half().to(DEV)
    ref = sparse_ffn_ref(x, up, gate, down_t, idx)
    for r, w, progs, eager in ((1, 4, 64, True), (2, 4, 2, True), (1, 8, 1, True), (2, 8, 2, False)):
        cfg = triton_ffn.Config(4, 1024, 4, 64, 32, 4, fused_r=r, fused_warps=w, fused_progs=progs, eager_down=eager)
        outs = [poisoned((1, D), torch.float16, DEV) for _ in range(20)]
        for out in outs:
            triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, None, "reglu", None, out, None, cfg)
        errs = [rel_err(out, ref) for out in outs]
        assert max(errs) < GPU_TOL[torch.float16], (r, w, progs, eager, errs)
    mask = token_bits((torch.rand(1, idx.numel(), generator=gen) < 0.5).to(DEV))
    nact = torch.tensor([N // 10 - 100], dtype=torch.int32, device=DEV)
    out = poisoned((1, D), torch.float16, DEV)
    g = torch.cuda.CUDAGraph()
    triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, "reglu", None, out, nact, cfg)  # compiled
    with torch.cuda.graph(g):
        triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, "reglu", None, out, nact, cfg)
    for _ in range(3):
        x.copy_(torch.randn(1, D, generator=gen).half().to(DEV))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, sparse_ffn_ref(x, up, gate, down_t, idx, mask, n_active=nact)) < GPU_TOL[torch.float16]
    y32, cnt = triton_fused._fused_scratch(x.device, D)
    assert not y32.any() and int(cnt) == 0


# ---- quantized rows (ggml Q4_0 / Q8_0, dequantized in registers) ---------------------------------
# Reference: float64 over the exactly dequantized rows, x as it is (the GPU kernels do not quantize
# x). fp32 accumulation (tf32x3 dots at T > 1) leaves ~1e-6; fp16 outputs add their rounding.
Q_TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def q_rows(N: int, D: int, qtype: str, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """N random rows of D weights as gguf-py's qtype blocks, on the GPU."""
    from gguf import GGMLQuantizationType as GQ
    from gguf.quants import quantize

    w = torch.randn(N, D, generator=gen) * scale
    return torch.from_numpy(quantize(w.numpy(), {"q4_0": GQ.Q4_0, "q8_0": GQ.Q8_0}[qtype])).to(DEV)


def what_differs(y: torch.Tensor, ref: torch.Tensor) -> str:
    """Where y and the float64 reference differ most, for a failure message."""
    d = (y.double().cpu() - ref.double().cpu()).abs()
    if not torch.isfinite(y).all():
        bad = (~torch.isfinite(y.cpu())).nonzero()[:3].tolist()
        return f"non-finite output at {bad} (of {y.numel()} elements)"
    at = divmod(int(d.argmax()), d.shape[-1])
    return (f"rel err {rel_err(y, ref):.2e}; max |diff| {float(d.max()):.3e} at (t, d) = {at}: "
            f"got {float(y.reshape(-1, d.shape[-1])[at]):.6g}, want {float(ref.reshape(-1, d.shape[-1])[at]):.6g}")


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("act", ["relu", "reglu", "swiglu"])
def test_sparse_ffn_on_quantized_rows(qtype, act):
    """sparse_ffn with a qtype (the default configs: two stages, elementwise at T == 1 and tl.dot
    above), every density and mask form, 1 / 8 / 32 / 40 tokens, fp16 and fp32 x."""
    gen = torch.Generator().manual_seed(len(act) * 7 + len(qtype))
    N, D = 1024, 640
    up, down_t = q_rows(N, D, qtype, gen, D ** -0.5), q_rows(N, D, qtype, gen)
    gate = None if act == "relu" else q_rows(N, D, qtype, gen, D ** -0.5)
    b = (torch.randn(N, generator=gen) * 0.5).to(DEV) if act == "relu" else None
    for i, density in enumerate(DENSITIES):
        K = n_active(density, N)
        for T in (1, 8, 32, 40):
            dt = torch.float16 if (i + T) % 2 else torch.float32
            x = torch.randn(T, D, generator=gen).to(dt).to(DEV)
            idx = make_idx(K, N, gen, torch.int32, DEV)
            mask = None if i % 3 == 0 else (torch.rand(T, K, generator=gen) < 0.6).to(DEV)
            if mask is not None and i % 3 == 2 and T <= 32:
                mask = token_bits(mask)
            y = sparse_ffn(x, up, gate, down_t, idx, mask, act, b, out=poisoned((T, D), dt, DEV), qtype=qtype)
            ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, b, qtype=qtype)
            if K == 0:
                assert torch.equal(y, torch.zeros_like(y)), f"{qtype} {act} T={T}: K = 0 must give zeros"
                continue
            assert rel_err(y, ref) < Q_TOL[dt], f"{qtype} {act} T={T} K={K} mask kind {i % 3} x {dt}: " + \
                what_differs(y, ref)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_quantized_ffn_at_llama13b_shape_and_in_a_graph(qtype, T):
    """The 13B shard at 10 % density on quantized rows, then the packed form with the device count
    replayed from a CUDA graph for new x."""

    gen = torch.Generator().manual_seed(T + len(qtype))
    N, D = 13824, 5120
    up, gate, down_t = (q_rows(N, D, qtype, gen, s) for s in (D ** -0.5, D ** -0.5, 1.0))
    idx = make_idx(N // 10, N, gen, torch.int32, DEV)
    x = torch.randn(T, D, generator=gen).half().to(DEV)
    y = sparse_ffn(x, up, gate, down_t, idx, out=poisoned((T, D), torch.float16, DEV), qtype=qtype)
    ref = sparse_ffn_ref(x, up, gate, down_t, idx, qtype=qtype)
    assert rel_err(y, ref) < Q_TOL[torch.float16], f"{qtype} T={T}: " + what_differs(y, ref)
    if T > 32:
        return
    mask = token_bits((torch.rand(T, idx.numel(), generator=gen) < 0.5).to(DEV))
    nact = torch.tensor([N // 10 - 100], dtype=torch.int32, device=DEV)
    out = poisoned((T, D), torch.float16, DEV)
    sparse_ffn(x, up, gate, down_t, idx, mask, out=out, n_active=nact, qtype=qtype)  # compiled
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sparse_ffn(x, up, gate, down_t, idx, mask, out=out, n_active=nact, qtype=qtype)
    for _ in range(3):
        x.copy_(torch.randn(T, D, generator=gen).half().to(DEV))
        g.replay()
        torch.cuda.synchronize()
        ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, n_active=nact, qtype=qtype)
        assert rel_err(out, ref) < Q_TOL[torch.float16], f"{qtype} T={T} graph replay: " + what_differs(out, ref)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("R, D", [(5120, 5120), (32000, 5120), (2048, 5120), (13824, 1024)],
                         ids=["attn", "head", "fc1", "fc2"])
def test_quantized_linear_at_real_shapes(qtype, R, D):
    """kernels.linear on quantized rows (attention projection, output head, predictor fc1 / fc2),
    the file's blocks and (Q4_0) the repacked rows a CUDA primary holds, at 1, 8, 32 and 40 tokens
    (the Triton GEMVs, then dequantized rows through cuBLAS in fp16), with a bias, against float64
    computed on the GPU; on blocks up to TOKENS_MAX tokens each token's row is the one it gets
    alone; the repacked GEMV also replayed from a CUDA graph for new x."""
    from powerinfer_ray.kernels.linear import linear, linear_ref
    from powerinfer_ray.kernels.quant import REPACKED, repack
    from powerinfer_ray.kernels.triton_linear import TOKENS_MAX

    gen = torch.Generator().manual_seed(R)
    w = q_rows(R, D, qtype, gen)
    b = torch.randn(R, generator=gen).to(DEV)
    forms = [(w, qtype)] + ([(repack(w, qtype), REPACKED[qtype])] if qtype in REPACKED else [])
    for wf, q in forms:
        for T in (1, 8, 32, 40):
            x = torch.randn(T, D, generator=gen).half().to(DEV)
            y = linear(x, wf, b, qtype=q)
            ref = linear_ref(x, w, b, qtype)
            tol = Q_TOL[torch.float32 if T <= 32 else torch.float16]
            assert y.shape == (T, R) and rel_err(y, ref) < tol, f"{q} T={T}: " + what_differs(y, ref)
            if q == qtype and 1 < T <= TOKENS_MAX:
                assert torch.equal(y[T - 1], linear(x[T - 1:], wf, b, qtype=q)[0]), f"{q} T={T}: token alone"
    if qtype not in REPACKED:
        return
    x = torch.randn(1, D, generator=gen).half().to(DEV)
    wr, rq = repack(w, qtype), REPACKED[qtype]
    linear(x, wr, b, qtype=rq)  # compiled
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = linear(x, wr, b, qtype=rq)
    for _ in range(2):
        x.copy_(torch.randn(1, D, generator=gen).half().to(DEV))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, linear_ref(x, w, b, qtype)) < Q_TOL[torch.float32], f"{rq} graph replay"


def test_predictor_of_the_residual_at_13b_shape_and_in_a_graph():
    """predictor_logits_of for one token (the cast, fc1 and ReLU in one Triton launch, then fc2) at
    the 13B predictor's shape against float64 on the rounded input, and replayed from a CUDA graph
    for new inputs; two tokens take torch's path, to the same values."""
    from powerinfer_ray.kernels.predictor import predictor_logits_of

    gen = torch.Generator().manual_seed(14)
    D, r, N = 5120, 1024, 13824
    fc1 = (torch.randn(r, D, generator=gen) * D ** -0.5).half().to(DEV)
    fc2 = (torch.randn(N, r, generator=gen) * r ** -0.5).half().to(DEV)
    ref = lambda h: torch.relu(h.half().double() @ fc1.double().T) @ fc2.double().T  # noqa: E731
    h = (torch.randn(1, D, generator=gen) * 3).to(DEV)
    got = predictor_logits_of(h, fc1, fc2, torch.float16)
    assert got.dtype == torch.float16 and rel_err(got, ref(h)) < GPU_TOL[torch.float16]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = predictor_logits_of(h, fc1, fc2, torch.float16)
    for _ in range(3):
        h.copy_((torch.randn(1, D, generator=gen) * 3).to(DEV))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref(h)) < GPU_TOL[torch.float16]
    h2 = (torch.randn(2, D, generator=gen) * 3).to(DEV)
    assert rel_err(predictor_logits_of(h2, fc1, fc2, torch.float16), ref(h2)) < GPU_TOL[torch.float16]


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_quantized_predictor_on_gpu(qtype):
    """predictor_logits with quantized fc1 [r, D] / fc2 [N, r] (upstream writes both as Q4_0)."""
    from powerinfer_ray.kernels import predictor_logits, predictor_logits_ref

    gen = torch.Generator().manual_seed(9)
    D, r, N = 5120, 1024, 13824
    fc1, fc2 = q_rows(r, D, qtype, gen, D ** -0.5), q_rows(N, r, qtype, gen, r ** -0.5)
    for T in (1, 8):
        x = torch.randn(T, D, generator=gen).half().to(DEV)
        got = predictor_logits(x, fc1, fc2, qtype)
        ref = predictor_logits_ref(x, fc1, fc2, qtype)
        assert got.dtype == x.dtype and rel_err(got, ref) < Q_TOL[torch.float16], f"{qtype} T={T}: " + \
            what_differs(got, ref)
