"""Cases of the Triton kernels for Triton's interpreter, run by test_triton_interpret.py in a
subprocess started with TRITON_INTERPRET=1 (the flag must be set before triton is first imported:
triton.language's own helpers are bound to the interpreter at import time).

The interpreter computes tl.dot on bf16 as raw uint16 bits, so bf16 is checked at T = 1 only
here (elementwise path); tests/gpu covers bf16 tl.dot on the device.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpret.py (needs TRITON_INTERPRET=1 at start)", allow_module_level=True)

triton = pytest.importorskip("triton")

from powerinfer_ray.kernels import local_index, sparse_ffn_ref, split_active, token_bits, unpack_active  # noqa: E402
from powerinfer_ray.kernels import triton_ffn, triton_split  # noqa: E402

from kernel_checks import TOL, make_idx, make_shard, poisoned, rel_err  # noqa: E402


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
            buf = triton_split.split_pack(logits, 0.0, gpu, loc, ng, N - ng, bn=512)
            parts = (buf[:1 + 2 * ng], buf[1 + 2 * ng:])
            for part, (idx, tok) in zip(parts, [(exact.gpu_idx, exact.gpu_tok_mask), (exact.cpu_idx, exact.cpu_tok_mask)]):
                got_idx, got_tok = unpack_active(part, T)
                assert torch.equal(got_idx, idx) and torch.equal(got_tok, tok)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["relu", "reglu", "swiglu"])
def test_triton_split_variant_matches_reference(dtype, act):
    """Config.up_sd / down_sk (T == 1): D split over programs with atomics into the pre-activations,
    the activation applied by the down stage, active rows split over programs into an fp32 y;
    against float64 for several splits (uneven last splits, more splits than tiles), a device
    count below len(idx), no active row, fp32 and fp16 outputs, and OPT's up bias (relu)."""
    gen = torch.Generator().manual_seed(len(act) + (dtype == torch.float16))
    N, D, K = 90, 70, 41
    up, gate, down_t, b = make_shard(N, D, dtype, act, act == "relu", gen)
    x = torch.randn(1, D, generator=gen).to(dtype)
    idx = make_idx(K, N, gen, torch.int32)
    for sd, sk in ((1, 1), (3, 2), (2, 5), (7, 13)):
        cfg = triton_ffn.Config(up_bk=8, up_bd=16, up_warps=4, down_bk=8, down_bd=32, down_warps=4,
                                up_sd=sd, down_sk=sk)
        assert cfg.split
        for n_act, out_dt in ((None, torch.float32), (torch.tensor([29], dtype=torch.int32), dtype),
                              (torch.tensor([0], dtype=torch.int32), dtype)):
            _check_t1(x, up, gate, down_t, idx, None, act, b, n_act, cfg, out_dt, f"split sd={sd} sk={sk}")
    out = poisoned((1, D), dtype)  # no active row at all
    y = triton_ffn.sparse_ffn_triton(x, up, gate, down_t, idx[:0], None, act, b, out, None, cfg)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("dtype, act", [(torch.float32, "relu"), (torch.float16, "reglu"), (torch.float16, "drelu")],
                         ids=str)
def test_triton_split_variant_over_tokens_matches_reference(dtype, act):
    """The split path at T > 1 (tl.dot kernels: up_sd programs over D add pre-activations with
    atomics, the down stage applies bias, activation and mask as it loads them, down_sk programs
    per column block add into an fp32 y): against float64 for uneven splits and more splits than
    tiles, both mask forms with a device count below len(idx) and of zero, T = 2 and a ragged
    block of MAX_T + 3 tokens, fp32 and fp16 outputs, and OPT's up bias (relu)."""
    gen = torch.Generator().manual_seed(7 + len(act))
    N, D, K = 90, 70, 41
    up, gate, down_t, b = make_shard(N, D, dtype, act, act == "relu", gen)
    idx = make_idx(K, N, gen, torch.int32)
    for T in (2, triton_ffn.MAX_T + 3):
        x = torch.randn(T, D, generator=gen).to(dtype)
        bits = torch.rand(T, K, generator=gen) < 0.6
        cases = [(None, None), (bits, torch.tensor([29], dtype=torch.int32)),
                 (token_bits(bits) if T <= 32 else bits, None), (None, torch.tensor([0], dtype=torch.int32))]
        for sd, sk in ((2, 1), (3, 2), (7, 5)):
            cfg = triton_ffn.Config(up_bk=16, up_bd=16, up_warps=4, down_bk=16, down_bd=32, down_warps=4,
                                    up_sd=sd, down_sk=sk)
            for (mask, n_act), out_dt in itertools.product(cases, (torch.float32, dtype)):
                out, xo = poisoned((T, D), out_dt), x.to(out_dt)  # fp32 x with fp16 weights: the tf32x3 dots
                y = triton_ffn.sparse_ffn_triton(xo, up, gate, down_t, idx, mask, act, b, out, n_act, cfg)
                ref = sparse_ffn_ref(xo, up, gate, down_t, idx, mask, act, b, n_active=n_act)
                what = f"T={T} sd={sd} sk={sk} mask={None if mask is None else mask.dtype} n_act={n_act} out {out_dt}"
                if n_act is not None and int(n_act) == 0:
                    assert torch.equal(y, torch.zeros_like(y)), what
                else:
                    assert rel_err(y, ref) < TOL[dtype], f"{what}: {rel_err(y, ref):.2e}"


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
    y32, cnt = triton_ffn._fused_scratch(x.device, 70)
    assert not y32.any() and int(cnt) == 0  # left zero for the next call
