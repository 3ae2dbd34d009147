"""Cases of the Triton kernels for Triton's interpreter, run by test_triton_interpret.py in a
subprocess started with TRITON_INTERPRET=1 (the flag must be set before triton is first imported:
triton.language's own helpers are bound to the interpreter at import time).

The interpreter computes tl.dot on bf16 as raw uint16 bits, so bf16 is checked at T = 1 only
here (elementwise path); tests/gpu covers bf16 tl.dot on the device.
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpret.py (needs TRITON_INTERPRET=1 at start)", allow_module_level=True)

triton = pytest.importorskip("triton")

from powerinfer_ray.kernels import local_index, sparse_ffn_ref, split_active, token_bits, unpack_active  # noqa: E402
from powerinfer_ray.kernels import triton_ffn, triton_fused, triton_split  # noqa: E402

from kernel_checks import TOL, make_idx, make_shard, poisoned, rel_err, swiglu_case, swiglu_oracle  # noqa: E402


def _fix_interpreter_for_numpy2() -> None:
    """triton's interpreter turns loop bounds into ints with int(ndarray of shape (1,)), which
    NumPy >= 2.4 refuses; index through .reshape(-1)[0] instead."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor
    if getattr(orig, "_pi_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pi_fixed = True
    interp._patch_lang_tensor = patched


_fix_interpreter_for_numpy2()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("act", ["relu", "reglu", "swiglu"])
def test_triton_sparse_ffn_matches_reference(dtype, T, act):
    # small tiles: several programs and loop steps; T == 1 also through the elementwise kernels
    dot = triton_ffn.Config(up_bk=4, up_bd=32, up_warps=4, down_bk=16, down_bd=32, down_warps=4)
    cfgs = [dot] if T > 1 else [dot, triton_ffn.Config(4, 32, 4, 16, 32, 4, up_dot=False, down_dot=False),
                                # whole rows: one masked step wider than D, one row per program
                                triton_ffn.Config(1, 128, 4, 16, 16, 2, up_dot=False, down_dot=False)]
    if dtype == torch.bfloat16:
        if T > 1:
            pytest.skip("interpreter computes bf16 tl.dot on raw bits")
        cfgs = cfgs[1:]
    gen = torch.Generator().manual_seed(T * 100 + len(act))
    N, D, K = 80, 70, 37
    up, gate, down_t, b = make_shard(N, D, dtype, act, act == "relu", gen)
    x = torch.randn(T, D, generator=gen).to(dtype)
    idx = make_idx(K, N, gen, torch.int32)
    cases = [(None, None), (torch.rand(T, K, generator=gen) < 0.6, None),
             (token_bits(torch.rand(T, K, generator=gen) < 0.6), torch.tensor([20], dtype=torch.int32))]
    for cfg in cfgs:
        for mask, n_active in cases:
            out = poisoned((T, D), dtype)
            y = triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, act, b, out, n_active, cfg)
            ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, b, n_active=n_active)
            err = rel_err(y, ref)
            assert err < TOL[dtype], f"{cfg} mask={None if mask is None else mask.dtype} n_active={n_active}: {err:.2e}"


def test_triton_split_matches_exact_split():
    gen = torch.Generator().manual_seed(5)
    for T in (1, 9):
        N = 2500
        logits = torch.randn(T, N, generator=gen) - 1.5
        gpu = torch.rand(N, generator=gen) < 0.3
        for loc in (None, local_index(gpu)):
            exact = split_active(logits, 0.0, gpu, loc)
            ng = int(gpu.sum())
            act0 = torch.arange(N, dtype=torch.int64)  # counters the split adds to in place
            act, stats = act0.clone(), torch.tensor([5, 7])
            buf = triton_split.split_pack(logits, 0.0, gpu, loc, ng, N - ng, bn=512, activity=act, stats=stats)
            parts = (buf[:1 + 2 * ng], buf[1 + 2 * ng:])
            for part, (idx, tok) in zip(parts, [(exact.gpu_idx, exact.gpu_tok_mask), (exact.cpu_idx, exact.cpu_tok_mask)]):
                got_idx, got_tok = unpack_active(part, T)
                assert torch.equal(got_idx, idx) and torch.equal(got_tok, tok)
            active = logits >= 0.0
            assert torch.equal(act, act0 + active.sum(0))
            assert stats.tolist() == [5 + int(exact.gpu_tok_mask.sum()), 7 + len(exact.gpu_idx)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("H, G", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_triton_decode_attention_matches_float64(dtype, H, G):
    """Keys 0..pos[b] of slot slots[b], blocks of 16 keys (several blocks, a partial last one)."""
    import math

    from powerinfer_ray.kernels.triton_attention import decode_attention_triton

    _fix_interpreter_for_numpy2()
    gen = torch.Generator().manual_seed(H + G)
    hd, S, n_slots = 16, 48, 4
    kc = torch.randn(n_slots, G, S, hd, generator=gen).to(dtype)
    vc = torch.randn(n_slots, G, S, hd, generator=gen).to(dtype)
    q = torch.randn(3, H, hd, generator=gen).to(dtype)
    slots, pos = torch.tensor([2, 0, 3]), torch.tensor([0, 17, 40])
    o = decode_attention_triton(q, kc, vc, slots, pos, 1.0 / math.sqrt(hd), block=16)
    for b in range(3):
        for h in range(H):
            g = h // (H // G)
            k, v = kc[slots[b], g, : pos[b] + 1].double(), vc[slots[b], g, : pos[b] + 1].double()
            p = torch.softmax(k @ q[b, h].double() / math.sqrt(hd), 0)
            assert rel_err(o[b, h], p @ v) < TOL[dtype], (b, h)


def test_triton_pack_bits_matches_torch():
    from powerinfer_ray.kernels.predictor import pack_active_bits

    gen = torch.Generator().manual_seed(9)
    for T, N, col0, n in ((1, 3000, 0, 3000), (4, 1000, 333, 601)):
        logits = torch.randn(T, N, generator=gen).half()
        got = triton_split.pack_bits(logits, 0.1, col0, n, by=16)  # several programs, a partial last one
        assert torch.equal(got, pack_active_bits(logits, 0.1, col0, n, backend="torch"))
        skip = torch.rand(n, generator=gen) < 0.4  # neurons another device computes: their bits stay clear
        got = triton_split.pack_bits(logits, 0.1, col0, n, skip, by=16)
        bits = torch.from_numpy(np.unpackbits(got.numpy(), axis=1, count=n, bitorder="little").astype(bool))
        assert torch.equal(bits, (logits[:, col0:col0 + n].float() >= 0.1) & ~skip)
        assert torch.equal(got, pack_active_bits(logits, 0.1, col0, n, backend="torch", skip=skip))
        out = torch.full((T, (n + 7) // 8), 0xAA, dtype=torch.uint8)  # into a given buffer (the channel's)
        assert pack_active_bits(logits, 0.1, col0, n, skip=skip, out=out) is out and torch.equal(out, got)
        out.fill_(0xAA)
        assert pack_active_bits(logits, 0.1, col0, n, backend="torch", skip=skip, out=out) is out
        assert torch.equal(out, got)


def test_triton_store_rows_copies_exactly():
    """The decode graph's staging of x into the channel: every element, two programs and a ragged
    end, nothing past the destination's rows."""
    from powerinfer_ray.kernels.triton_signal import store_rows

    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(23)).half()
    dst = torch.zeros(4, 5000, dtype=torch.float16)
    store_rows(x, dst[:3])
    assert torch.equal(dst[:3], x) and not dst[3].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_predictor_hidden_matches_float64(dtype):
    """The predictor's first layer for one token: relu(fc1 . x) with x the fp32 residual rounded to the
    model's dtype inside the kernel, rows past a program's block and columns past a step's masked off:
    against float64 on the same rounded x."""
    from powerinfer_ray.kernels.triton_predictor import predictor_hidden

    gen = torch.Generator().manual_seed(31)
    R, D = 1030, 2100  # neither a multiple of the row block nor of the column step
    h = torch.randn(1, D, generator=gen) * 3
    fc1 = (torch.randn(R, D, generator=gen) * D ** -0.5).to(dtype)
    z = predictor_hidden(h, fc1, dtype)
    want = torch.relu(h.to(dtype).double() @ fc1.double().T)
    assert z.dtype == dtype and z.shape == (1, R) and (z >= 0).all()
    assert rel_err(z, want) < TOL[dtype], rel_err(z, want)


def test_triton_sparse_ffn_over_max_t_tokens_runs_in_blocks():
    """T > MAX_T (a prefill chunk) is computed in blocks of MAX_T tokens, the last one ragged:
    equal to the reference."""
    gen = torch.Generator().manual_seed(13)
    N, D, K, T = 48, 40, 21, 2 * triton_ffn.MAX_T + 6
    up, gate, down_t, b = make_shard(N, D, torch.float32, "reglu", False, gen)
    x = torch.randn(T, D, generator=gen)
    idx = make_idx(K, N, gen, torch.int32)
    mask = torch.rand(T, K, generator=gen) < 0.5
    cfg = triton_ffn.Config(up_bk=16, up_bd=32, up_warps=4, down_bk=16, down_bd=32, down_warps=4)
    out = poisoned((T, D), torch.float32)
    y = triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, "reglu", b, out, None, cfg)
    assert rel_err(y, sparse_ffn_ref(x, up, gate, down_t, idx, mask, "reglu", b)) < TOL[torch.float32]


def _check_t1(x, up, gate, down_t, idx, mask, act, b, n_act, cfg, out_dt, what: str) -> None:
    """One T == 1 call into a poisoned out of out_dt against float64: within TOL, or exactly zero
    when the device count n_act is 0."""
    out = poisoned((1, x.shape[1]), out_dt)
    y = triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, act, b, out, n_act, cfg)
    assert y is out
    if n_act is not None and int(n_act) == 0:
        assert torch.equal(y, torch.zeros_like(y)), what
        return
    err = rel_err(y, sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, b, n_active=n_act))
    assert err < TOL[out_dt], f"{what} n_active={n_act} out {out_dt}: {err:.2e}"


@pytest.mark.parametrize("dtype, act", [(torch.float32, "relu"), (torch.float16, "reglu"),
                                       (torch.bfloat16, "drelu"), (torch.float32, "swiglu")], ids=str)
def test_triton_fused_matches_reference(dtype, act):
    """Config.fused_r (T == 1, one launch: programs walk blocks of rows, sums added into an fp32
    scratch with atomics, the last program writes y): against float64 with D a power of two (one
    piece) and not (a masked second piece), programs that walk several blocks and one each, rows
    per block that leave a partial last block, eager and lazy down rows, both mask forms, a device
    count below len(idx) and of zero, and calls back to back (each must leave the scratch zero)."""
    gen = torch.Generator().manual_seed(len(act) + (dtype == torch.float16))
    N, K = 90, 37
    for D in (64, 70):
        up, gate, down_t, b = make_shard(N, D, dtype, act, act == "relu", gen)
        idx = make_idx(K, N, gen, torch.int32)
        cases = [(None, None), (torch.rand(1, K, generator=gen) < 0.6, None),
                 (token_bits(torch.rand(1, K, generator=gen) < 0.6), torch.tensor([20], dtype=torch.int32)),
                 (None, torch.tensor([0], dtype=torch.int32))]
        # (rows per block, programs per SM: the interpreter counts 4 SMs, eager down rows)
        for r, progs, eager in ((1, 1, True), (2, 2, False), (4, 16, True)):
            cfg = triton_ffn.Config(4, 32, 4, 16, 32, 4, fused_r=r, fused_warps=2, fused_progs=progs, eager_down=eager)
            for mask, n_act in cases:
                x = torch.randn(1, D, generator=gen).to(dtype)
                _check_t1(x, up, gate, down_t, idx, mask, act, b, n_act, cfg, dtype,
                          f"D={D} r={r} progs={progs} eager={eager} mask={mask is not None}")
    y32, cnt = triton_fused._fused_scratch(x.device, 70)
    assert not y32.any() and int(cnt) == 0  # left zero for the next call


def q_rows(N: int, D: int, qtype: str, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """N random rows of D weights as gguf-py's qtype blocks (uint8 [N, D // 32 * block bytes])."""
    from gguf import GGMLQuantizationType as GQ
    from gguf.quants import quantize

    w = torch.randn(N, D, generator=gen) * scale
    return torch.from_numpy(quantize(w.numpy(), {"q4_0": GQ.Q4_0, "q8_0": GQ.Q8_0}[qtype]))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("act", ["relu", "reglu", "swiglu"])
def test_triton_sparse_ffn_on_quantized_rows(qtype, act):
    """Every FFN kernel quantized rows run (elementwise and tl.dot two-stage at T == 1, the fused
    kernel at T == 1, tl.dot at T > 1) on ggml blocks dequantized in registers, against float64
    over the dequantized rows (x as it is): D of 3 blocks, 2 (one power-of-two piece) and 7 (a
    masked second piece), both mask forms, a device count, OPT's up bias, fp32 and fp16 x; the
    fused kernel with one and several programs a block of rows (the interpreter counts 4 SMs),
    eager and lazy down rows, a partial last block, and a device count of zero."""
    gen = torch.Generator().manual_seed(len(act) + len(qtype))
    N, K = 60, 23
    # tiles of one block and of two (the Q4_0 tiles' column order within and across blocks)
    t1 = [triton_ffn.Config(4, 64, 4, 16, 64, 4), triton_ffn.Config(4, 32, 4, 16, 32, 4),
          triton_ffn.Config(4, 32, 4, 16, 32, 4, up_dot=False, down_dot=False),
          triton_ffn.Config(4, 64, 4, 16, 64, 4, up_dot=False, down_dot=False),
          triton_ffn.Config(4, 32, 4, 16, 32, 4, fused_r=2, fused_warps=2, fused_progs=1, eager_down=False),
          triton_ffn.Config(4, 32, 4, 16, 32, 4, fused_r=1, fused_warps=2, fused_progs=1, eager_down=True),
          triton_ffn.Config(4, 32, 4, 16, 32, 4, fused_r=4, fused_warps=4, fused_progs=16, eager_down=True)]
    for D in (96, 64, 224):
        up, down_t = q_rows(N, D, qtype, gen, D ** -0.5), q_rows(N, D, qtype, gen)
        gate = None if act == "relu" else q_rows(N, D, qtype, gen, D ** -0.5)
        b = torch.randn(N, generator=gen) * 0.5 if act == "relu" else None
        idx = make_idx(K, N, gen, torch.int32)
        # the fused kernel at D = 64 (one power-of-two piece) and 224 (a masked second piece; all three)
        fused = t1[4:5] if D == 64 else []
        for T, cfgs in ((1, t1[:4] + fused), (3, t1[:2])) if D < 224 else ((1, t1[4:]),):
            cases = [(None, None), (torch.rand(T, K, generator=gen) < 0.6, None),
                     (token_bits(torch.rand(T, K, generator=gen) < 0.6), torch.tensor([15], dtype=torch.int32)),
                     (None, torch.tensor([0], dtype=torch.int32))]
            for cfg, (mask, n_act) in itertools.product(cfgs, cases):
                for dt in (torch.float32, torch.float16):
                    x = torch.randn(T, D, generator=gen).to(dt)
                    out = poisoned((T, D), dt)
                    y = triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx, mask, act, b, out, n_act, cfg,
                                                     qtype=qtype)
                    assert y is out
                    if n_act is not None and int(n_act) == 0:
                        assert torch.equal(y, torch.zeros_like(y)), f"D={D} T={T} {cfg}: no active rows, y not 0"
                        continue
                    ref = sparse_ffn_ref(x, up, gate, down_t, idx, mask, act, b, n_act, qtype=qtype)
                    err = rel_err(y, ref)
                    assert err < TOL[dt], f"D={D} T={T} {cfg} mask={mask is not None} {dt}: {err:.2e}"


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_triton_linear_on_quantized_rows(qtype):
    """The dense GEMV (attention projections, output head, predictor) at T = 1, 5 and TOKENS_MAX (one
    program per row block and token) and TOKENS_MAX + 3 (tl.dot, two launches), with a bias, against
    float64; with ``relu`` (the predictor's fc1) the same clamped at 0. Up to TOKENS_MAX tokens each
    token's row is the one it gets alone."""
    from powerinfer_ray.kernels.linear import linear_ref
    from powerinfer_ray.kernels.triton_linear import TOKENS_MAX, linear_triton

    gen = torch.Generator().manual_seed(3)
    R, D = 45, 160
    w = q_rows(R, D, qtype, gen)
    b = torch.randn(R, generator=gen)
    for T in (1, 5, TOKENS_MAX, TOKENS_MAX + 3):
        x = torch.randn(T, D, generator=gen)
        y, want = linear_triton(x, w, qtype, b), linear_ref(x, w, b, qtype)
        assert y.dtype == torch.float32 and rel_err(y, want) < TOL[torch.float32], T
        relu = linear_triton(x, w, qtype, b, relu=True)
        assert (want < 0).any() and rel_err(relu, want.clamp(min=0)) < TOL[torch.float32], T
        if 1 < T <= TOKENS_MAX:
            for t in (0, T - 1):
                assert torch.equal(y[t], linear_triton(x[t:t + 1], w, qtype, b)[0]), (T, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_qgemv_on_repacked_rows(dtype):
    """The repacked Q4_0 rows' GEMV (triton_qgemv) against float64 over the file's blocks: rows not a
    multiple of a program's, fewer blocks than a step takes (D = 192) and a partial last step (D =
    1280), with and without a bias, T = 1 and 3 (the token axis of the grid)."""
    from powerinfer_ray.kernels.linear import linear_ref
    from powerinfer_ray.kernels.quant import REPACKED, repack
    from powerinfer_ray.kernels.triton_qgemv import qgemv_triton

    gen = torch.Generator().manual_seed(5)
    qtype = "q4_0"
    for R, D in ((45, 192), (19, 1280)):
        w = q_rows(R, D, qtype, gen)
        wr = repack(w, qtype)
        for bias in (None, torch.randn(R, generator=gen)):
            for T in (1, 3):
                x = torch.randn(T, D, generator=gen).to(dtype)
                y = qgemv_triton(x, wr, REPACKED[qtype], bias)
                ref = linear_ref(x, w, bias, qtype)
                assert y.dtype == torch.float32 and rel_err(y, ref) < TOL[torch.float32], (R, D, T, bias is None)


@pytest.mark.parametrize("on", ["gate", "h"])
@pytest.mark.parametrize("T", [1, 3])
def test_triton_activation_threshold_and_precomputed_gate(on, T):
    """The SwiGLU options in every FFN kernel (fused, elementwise and tl.dot at T == 1, tl.dot at
    T > 1): act_threshold on |SiLU(g)| or |h|, with the gate rows or precomputed gate values
    (gate_pre, gate=None), both mask forms and a device count, against the model's thresholded FFN."""
    gen = torch.Generator().manual_seed(T + len(on))
    N, D, K = 90, 70, 41
    x, up, gate, down_t, t = swiglu_case(N, D, T, torch.float32, on, gen)
    g = (x @ gate.T).contiguous()  # [T, N] fp32
    idx = make_idx(K, N, gen, torch.int32)
    tok = torch.rand(T, K, generator=gen) < 0.7
    cfgs = [triton_ffn.Config(4, 32, 4, 16, 32, 4)]
    if T == 1:
        cfgs += [triton_ffn.Config(4, 32, 4, 16, 32, 4, up_dot=False, down_dot=False),
                 triton_ffn.Config(4, 32, 4, 16, 32, 4, fused_r=2, fused_warps=2, fused_progs=1, eager_down=False),
                 triton_ffn.Config(4, 32, 4, 16, 32, 4, fused_r=1, fused_warps=2, fused_progs=2, eager_down=True)]
    cases = [(None, None, K), (tok, None, K), (token_bits(tok), torch.tensor([25], dtype=torch.int32), 25)]
    for cfg, (mask, n_act, k), pre in itertools.product(cfgs, cases, (False, True)):
        out = poisoned((T, D), torch.float32)
        y = triton_ffn.sparse_ffn_triton(x, up, None if pre else gate, down_t, idx, mask, "swiglu", None, out, n_act,
                                         cfg, act_threshold=t, act_on=on, gate_pre=g if pre else None)
        m = tok[:, :k] if mask is not None else None
        want = swiglu_oracle(x, up, gate, down_t, idx[:k], t, on, m)
        assert y is out and rel_err(y, want) < TOL[torch.float32], f"{cfg} mask={mask is not None} pre={pre}"


def test_triton_split_of_gate_values():
    """silu=True: the packed split of gate values by |SiLU(g)| > t, as the exact torch criterion."""
    from powerinfer_ray.kernels.predictor import active_of

    gen = torch.Generator().manual_seed(6)
    for T in (1, 7):
        N = 1500
        g = torch.randn(T, N, generator=gen) * 2
        gpu = torch.ones(N, dtype=torch.bool)
        buf = triton_split.split_pack(g, 0.4, gpu, None, N, 0, bn=512, silu=True)
        idx, tok = unpack_active(buf[:1 + 2 * N], T)
        act = active_of(g, 0.4, silu=True)
        want = act.any(0).nonzero().reshape(-1)
        assert torch.equal(idx, want) and torch.equal(tok, act[:, want])


def test_triton_rms_norm_matches_float64():
    """The norm and the cast in one program a row: D not a power of two (a masked tail), fp16 and
    fp32 out, against the float64 reference."""
    from powerinfer_ray.kernels.norm import rms_norm_ref
    from powerinfer_ray.kernels.triton_norm import rms_norm_triton

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 200, generator=gen) * 3
    w = torch.rand(200, generator=gen) + 0.5
    want = rms_norm_ref(x, w, 1e-5)
    for dtype in (torch.float16, torch.float32):
        y = rms_norm_triton(x, w, 1e-5, dtype)
        assert y.dtype == dtype and rel_err(y, want) < TOL[dtype]


def test_triton_add_rms_norm_matches_float64():
    """The partial outputs (0 to 4, fp16 and fp32) and the bias added to the fp32 residual in place,
    then its norm, in one program a row: against the float64 sum and norm."""
    from powerinfer_ray.kernels.norm import rms_norm_ref
    from powerinfer_ray.kernels.triton_norm import add_rms_norm_triton

    gen = torch.Generator().manual_seed(22)
    w = torch.rand(200, generator=gen) + 0.5
    for n_parts, bias in ((0, True), (1, False), (4, True)):
        h = torch.randn(3, 200, generator=gen) * 3
        parts = [torch.randn(3, 200, generator=gen).to(torch.float16 if i % 2 else torch.float32)
                 for i in range(n_parts)]
        b = torch.randn(200, generator=gen) if bias else None
        want_h = h.double() + sum(p.double() for p in parts) + (b.double() if bias else 0)
        y = add_rms_norm_triton(h, parts, b, w, 1e-5, torch.float16)
        assert rel_err(h, want_h) < 1e-6
        assert y.dtype == torch.float16 and rel_err(y, rms_norm_ref(want_h, w, 1e-5)) < TOL[torch.float16]


@pytest.mark.parametrize("style, n_rot", [("norm", 32), ("neox", 32), ("neox", 16), (None, 32)])
def test_triton_rope_cache_equals_the_torch_steps(style, n_rot):
    """The decode token's rotary embedding and KV-cache write in one launch: the rotated q and the
    cache rows of the torch path (kernels.attention.rope, then indexed writes), which
    tests/kernels/test_attention.py checks against float64; GQA, partial rotary, rows of other
    slots untouched."""
    from powerinfer_ray.kernels.attention import _rope_cache_torch, rope_table
    from powerinfer_ray.kernels.triton_attention import rope_cache_triton

    gen = torch.Generator().manual_seed(17)
    B, Hs, Gs, hd, S, L = 3, 4, 2, 32, 4, 24
    qkv = torch.randn(B, (Hs + 2 * Gs) * hd, generator=gen).half()
    slots, pos = torch.tensor([2, 0, 3]), torch.tensor([5, 17, 0])
    cos_t, sin_t = rope_table(L, n_rot, 10000.0, "cpu")
    cos, sin = (cos_t[pos], sin_t[pos]) if style else (None, None)
    caches = [torch.randn(S, Gs, L, hd, generator=gen).half() for _ in range(2)]
    want_k, want_v = caches[0].clone(), caches[1].clone()
    want_q = _rope_cache_torch(qkv.view(B, Hs + 2 * Gs, hd), cos, sin, style, n_rot, want_k, want_v, slots, pos, Hs)
    k, v = caches[0].clone(), caches[1].clone()
    q = rope_cache_triton(qkv, cos, sin, style, n_rot, k, v, slots, pos, Hs, Gs)
    assert rel_err(q, want_q) < TOL[torch.float16]
    assert rel_err(k, want_k) < TOL[torch.float16] and torch.equal(v, want_v)
    assert torch.equal(k[1], caches[0][1])  # slot 1 holds no sequence of the step
