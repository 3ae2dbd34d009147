"""The CPU kernel's SwiGLU activation threshold (cpu_ffn.sparse_ffn_bitmask / sparse_ffn with
act_threshold): gate-first over every row and the predicted mode's threshold on a mask, against the
model's own thresholded FFN, with the counts of rows whose gate, up and down rows were read."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from powerinfer_ray.kernels import cpu_ffn

from kernel_checks import DTYPES, TOL, make_idx, poisoned, rel_err, swiglu_case, swiglu_oracle

needs_compiler = pytest.mark.skipif(not cpu_ffn.available(), reason="no C++ compiler: compiled kernel unavailable")


def pack(mask: torch.Tensor) -> np.ndarray:
    return np.packbits(mask.numpy(), axis=1, bitorder="little")


def expected_counts(x, gate, mask, t, on):
    """(pairs, rows, up rows) of a call over bool mask [T, n] (None: every row): pairs of the mask
    (without one: those whose gate passes, on 'gate'), rows active in the mask, and the rows whose
    up row is read (on 'gate': a masked-in token's gate passes)."""
    T, n = x.shape[0], gate.shape[0]
    m = torch.ones(T, n, dtype=torch.bool) if mask is None else mask
    g = x.double() @ gate.double().T  # [T, n]
    passes = m & (F.silu(g).abs() > t) if on == "gate" else m
    pairs = int(passes.sum()) if mask is None and on == "gate" else int(m.sum())
    return pairs, int(m.any(0).sum()), int(passes.any(0).sum())


@needs_compiler
@pytest.mark.parametrize("on", ["gate", "h"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", ["rows", "cols"])
def test_bitmask_threshold_matches_the_thresholded_ffn(on, dtype, split):
    """Every row (gate-first) and a predicted mask, T = 1 (four rows per pass), a few tokens and
    more than 64 (two token blocks): the output of the model's thresholded FFN over the rows of
    the mask, the pairs and rows of the mask, the up rows of the rows whose gate passes, and down
    rows only of rows with a nonzero h."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{on}{dtype}{split}".encode()))
    n, D = 203, 96
    for T in (1, 5, 70):
        x, up, gate, down_t, t = swiglu_case(n, D, T, dtype, on, gen)
        for mask in (None, torch.rand(T, n, generator=gen) < 0.6):
            out = poisoned((T, D), torch.float32)
            pairs, rows, down_rows, up_rows = cpu_ffn.sparse_ffn_bitmask(
                x, up, gate, down_t, None if mask is None else pack(mask), n, "swiglu", None, out, 2, split=split,
                act_threshold=t, act_on=on)
            want = swiglu_oracle(x, up, gate, down_t, torch.arange(n), t, on, mask)
            what = f"T={T} mask={mask is not None}"
            assert rel_err(out, want) < max(TOL[dtype], 1e-5), what
            want_pairs, want_rows, want_up = expected_counts(x, gate, mask, t, on)
            if T <= 64:  # more tokens run in blocks of 64, whose counts add up per block
                assert (pairs, rows, up_rows) == (want_pairs, want_rows, want_up), what
            assert down_rows <= up_rows <= rows * -(-T // 64), what  # up / down rows: summed over the blocks


@needs_compiler
def test_gate_first_reads_no_up_row_of_a_row_whose_gate_fails():
    """Rows whose gate never passes: their up and down rows are never touched (NaN there does not
    reach the output), and the counts say so."""
    gen = torch.Generator().manual_seed(3)
    n, D, T = 64, 64, 2
    x, up, gate, down_t, t = swiglu_case(n, D, T, torch.float32, "gate", gen)
    fails = ~(F.silu(x.double() @ gate.double().T).abs() > t).any(0)  # [n]
    assert 5 < int(fails.sum()) < n - 5
    up_poisoned, down_poisoned = up.clone(), down_t.clone()
    up_poisoned[fails] = float("nan")
    down_poisoned[fails] = float("nan")
    out = poisoned((T, D), torch.float32)
    pairs, rows, down_rows, up_rows = cpu_ffn.sparse_ffn_bitmask(x, up_poisoned, gate, down_poisoned, None, n,
                                                                 "swiglu", None, out, 2, act_threshold=t)
    assert torch.isfinite(out).all() and rel_err(out, swiglu_oracle(x, up, gate, down_t, torch.arange(n), t, "gate")) < 1e-5
    assert rows == n and up_rows == n - int(fails.sum()) and down_rows == up_rows


@needs_compiler
def test_threshold_over_row_ids_and_quantized_rows():
    """In-place shards (rows=) and Q8_0 rows: the same as gathered rows, and as the thresholded FFN
    of the Q8_0-rounded x over the dequantized rows."""
    from powerinfer_ray.kernels.quant import dequantize, quantize_q8_0, round_q8_0

    gen = torch.Generator().manual_seed(4)
    N, D, T = 150, 64, 3
    x, up, gate, down_t, _ = swiglu_case(N, D, T, torch.float32, "gate", gen)
    ids = make_idx(90, N, gen, torch.int32).sort().values
    sel = ids.long()
    g = F.silu(x.double() @ gate[sel].double().T).abs()
    t = float(g.flatten().sort().values[g.numel() // 2])  # (ties at t are rows above it or not alike)
    a, b = poisoned((T, D), torch.float32), poisoned((T, D), torch.float32)
    sa = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None, 90, "swiglu", None, a, 2, rows=ids, act_threshold=t)
    sb = cpu_ffn.sparse_ffn_bitmask(x, up[sel], gate[sel], down_t[sel], None, 90, "swiglu", None, b, 2, act_threshold=t)
    assert sa == sb and rel_err(a, b) < 1e-6
    q = [quantize_q8_0(w) for w in (up, gate, down_t)]
    out = poisoned((T, D), torch.float32)
    cpu_ffn.sparse_ffn_bitmask(x, *q, None, N, "swiglu", None, out, 2, qtype="q8_0", act_threshold=0.3)
    deq = [dequantize(w, "q8_0", torch.float64) for w in q]
    want = swiglu_oracle(round_q8_0(x), deq[0], deq[1], deq[2], torch.arange(N), 0.3, "gate")
    assert rel_err(out, want) < 1e-4


def test_fallback_without_compiler_counts_alike(monkeypatch):
    """The torch path gives the kernel's counts (up rows: rows whose gate passes)."""
    gen = torch.Generator().manual_seed(5)
    n, D, T = 80, 32, 3
    x, up, gate, down_t, t = swiglu_case(n, D, T, torch.float32, "gate", gen)
    mask = torch.rand(T, n, generator=gen) < 0.5
    monkeypatch.setattr(cpu_ffn, "library", lambda: None)
    for m in (None, mask):
        out = poisoned((T, D), torch.float32)
        pairs, rows, _, up_rows = cpu_ffn.sparse_ffn_bitmask(x, up, gate, down_t, None if m is None else pack(m), n,
                                                             "swiglu", None, out, act_threshold=t)
        assert (pairs, rows, up_rows) == expected_counts(x, gate, m, t, "gate")
        assert rel_err(out, swiglu_oracle(x, up, gate, down_t, torch.arange(n), t, "gate", m)) < 1e-5


@pytest.mark.parametrize("kwargs, match", [(dict(act="reglu"), "act"), (dict(act_threshold=-0.5), "act_threshold"),
                                           (dict(act_on="u"), "act_on")])
def test_bad_threshold_arguments_name_the_field(kwargs, match):
    w = torch.randn(8, 16)
    args = dict(x=torch.randn(1, 16), up=w, gate=w, down_t=w, packed_mask=None, n=8, act="swiglu", up_bias=None,
                out=torch.empty(1, 16), act_threshold=0.2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cpu_ffn.sparse_ffn_bitmask(**args)
