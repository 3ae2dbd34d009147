"""Rotary embedding and attention over a shard of heads against the float64 loop reference."""
from __future__ import annotations

import math

import pytest
import torch

from powerinfer_ray.kernels import head_attention, head_attention_ref, rope

from kernel_checks import rel_err

ATT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def test_rope_norm_rotates_adjacent_pairs_by_hand():
    x = torch.zeros(1, 1, 4, dtype=torch.float64)  # [T, H, hd]
    x[0, 0] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    pos = torch.tensor([3])
    y = rope(x, pos, theta=100.0, style="norm")
    a0, a1 = 3 * 1.0, 3 * 100.0 ** (-2 / 4)  # angles pos * theta^(-2i/n_rot), i = 0, 1
    want = torch.tensor([math.cos(a0), math.sin(a0), math.cos(a1), math.sin(a1)], dtype=torch.float64)
    assert torch.allclose(y[0, 0], want)


def test_rope_neox_is_norm_on_the_interleaved_permutation():
    """neox pairs (i, i + n/2); norm pairs (2i, 2i+1): permuting dims maps one onto the other."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=gen, dtype=torch.float64)  # [B, T, H, hd]
    pos = torch.randint(0, 100, (2, 5), generator=gen)
    perm = torch.stack((torch.arange(8), torch.arange(8) + 8), dim=1).flatten()  # 0, 8, 1, 9, ...
    neox = rope(x, pos, 10000.0, "neox")
    norm = rope(x[..., perm], pos, 10000.0, "norm")
    assert torch.allclose(neox[..., perm], norm)


def test_rope_partial_rotation_passes_the_rest_and_keeps_norms():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 12, generator=gen)
    y = rope(x, torch.arange(4), 10000.0, "neox", n_rot=8)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert torch.allclose(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match="style"):
        rope(x, torch.arange(4), style="gptj")


def _weights(H, G, hd, D, dtype, gen, bias):
    def r(*s, scale):
        return (torch.randn(*s, generator=gen) * scale).to(dtype)

    w = dict(wq=r(H * hd, D, scale=D ** -0.5), wk=r(G * hd, D, scale=D ** -0.5), wv=r(G * hd, D, scale=D ** -0.5),
             wo_t=r(H * hd, D, scale=(H * hd) ** -0.5))
    if bias:
        w.update(bq=r(H * hd, scale=0.3), bk=r(G * hd, scale=0.3), bv=r(G * hd, scale=0.3))
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H, G", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("style", ["norm", "neox", None])
def test_head_attention_matches_reference(dtype, H, G, style):
    gen = torch.Generator().manual_seed(H * 10 + G)
    B, T, D, hd, slots_n, S = 3, 4, 48, 8, 5, 40
    w = _weights(H, G, hd, D, dtype, gen, bias=style is None)  # OPT-like: biases, learned positions
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    cache = [torch.randn(slots_n, G, S, hd, generator=gen).to(dtype) for _ in range(2)]  # history
    ref_cache = [c.clone() for c in cache]
    slots, start = [4, 0, 2], [7, 0, 30]  # three sequences of different lengths
    n_rot = 6 if style == "neox" else None  # partial rotary on one style
    y = head_attention(x, k_cache=cache[0], v_cache=cache[1], slots=slots, start_pos=start, rope_theta=500.0,
                       rope_style=style, n_rot=n_rot, **w)
    ref = head_attention_ref(x, k_cache=ref_cache[0], v_cache=ref_cache[1], slots=slots, start_pos=start,
                             rope_theta=500.0, rope_style=style, n_rot=n_rot, **w)
    assert y.shape == (B, T, D) and y.dtype == dtype
    assert rel_err(y, ref) < ATT_TOL[dtype]
    for c, rc in zip(cache, ref_cache):  # new K/V written where the reference writes them
        assert rel_err(c, rc) < ATT_TOL[dtype]
    untouched = cache[0][1]  # slot 1 belongs to no sequence
    assert torch.equal(untouched, ref_cache[0][1])


def test_decode_after_prefill_equals_one_prefill():
    gen = torch.Generator().manual_seed(2)
    B, D, H, G, hd, S = 1, 32, 4, 2, 8, 16
    w = _weights(H, G, hd, D, torch.float32, gen, bias=False)
    x = torch.randn(B, 6, D, generator=gen)
    c1 = [torch.zeros(1, G, S, hd) for _ in range(2)]
    c2 = [torch.zeros(1, G, S, hd) for _ in range(2)]
    full = head_attention(x, k_cache=c1[0], v_cache=c1[1], slots=[0], start_pos=[0], **w)
    head_attention(x[:, :4], k_cache=c2[0], v_cache=c2[1], slots=[0], start_pos=[0], **w)
    step = [head_attention(x[:, t:t + 1], k_cache=c2[0], v_cache=c2[1], slots=[0], start_pos=[t], **w)
            for t in (4, 5)]
    assert rel_err(torch.cat(step, 1), full[:, 4:]) < 1e-5


def test_partial_outputs_of_disjoint_head_shards_add_up_to_full_attention():
    gen = torch.Generator().manual_seed(3)
    B, T, D, H, G, hd, S = 2, 3, 64, 8, 4, 8, 20
    n_gqa = H // G
    w = _weights(H, G, hd, D, torch.float32, gen, bias=True)
    x = torch.randn(B, T, D, generator=gen)
    kc, vc = torch.randn(2, G, S, hd, generator=gen), torch.randn(2, G, S, hd, generator=gen)
    args = dict(slots=[1, 0], start_pos=[5, 2], rope_theta=10000.0, rope_style="norm")
    full = head_attention(x, k_cache=kc.clone(), v_cache=vc.clone(), **args, **w)
    total = torch.zeros_like(full)
    for groups in ([0, 3], [1], [2]):  # disjoint KV groups and their query heads
        heads = [g * n_gqa + j for g in groups for j in range(n_gqa)]
        qrows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])
        krows = torch.cat([torch.arange(g * hd, (g + 1) * hd) for g in groups])
        shard = dict(wq=w["wq"][qrows], wk=w["wk"][krows], wv=w["wv"][krows], wo_t=w["wo_t"][qrows],
                     bq=w["bq"][qrows], bk=w["bk"][krows], bv=w["bv"][krows])
        total += head_attention(x, k_cache=kc[:, groups].clone(), v_cache=vc[:, groups].clone(), **args, **shard)
    assert rel_err(total, full) < 1e-5


def test_head_attention_rejects_inconsistent_shapes():
    D, hd = 16, 4
    kc = torch.zeros(1, 2, 8, hd)
    with pytest.raises(ValueError, match="wk.shape"):
        head_attention(torch.zeros(1, 1, D), torch.zeros(4 * hd, D), torch.zeros(3 * hd, D), torch.zeros(2 * hd, D),
                       torch.zeros(4 * hd, D), kc, kc.clone(), [0], [0])
    with pytest.raises(ValueError, match="S_max"):
        head_attention(torch.zeros(1, 2, D), torch.zeros(4 * hd, D), torch.zeros(2 * hd, D), torch.zeros(2 * hd, D),
                       torch.zeros(4 * hd, D), kc, kc.clone(), [0], [7])


@pytest.mark.parametrize("H, G", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("style", ["norm", "neox", None])
@pytest.mark.parametrize("fused", [True, False], ids=["wqkv", "separate"])
@pytest.mark.parametrize("bias", [False, True])
def test_one_sequence_path_matches_reference(H, G, style, fused, bias):
    """B = 1 with host positions takes the short path (one projection, slice cache writes, no
    mask at T = 1): prefill then decode steps equal the float64 reference, cache included."""
    gen = torch.Generator().manual_seed(7)
    hd, D, S = 8, 32, 24
    w = _weights(H, G, hd, D, torch.float32, gen, bias)
    extra = {}
    if fused:
        extra["wqkv"] = torch.cat([w["wq"], w["wk"], w["wv"]])
        if bias:
            extra["bqkv"] = torch.cat([w["bq"], w["bk"], w["bv"]])
    cache = [torch.zeros(2, G, S, hd) for _ in range(2)]
    ref_cache = [torch.zeros(2, G, S, hd, dtype=torch.float64) for _ in range(2)]
    x = torch.randn(1, 9, D, generator=gen)
    pieces = [(0, 5), (5, 6), (6, 7), (7, 9)]  # a 5-token prefill, two decode steps, a 2-token chunk
    for a, b in pieces:
        y = head_attention(x[:, a:b], k_cache=cache[0], v_cache=cache[1], slots=[1], start_pos=[a],
                           rope_theta=500.0, rope_style=style, **w, **extra)
        ref = head_attention_ref(x[:, a:b].double(), k_cache=ref_cache[0], v_cache=ref_cache[1], slots=[1],
                                 start_pos=[a], rope_theta=500.0, rope_style=style,
                                 **{k: v.double() for k, v in w.items()})
        assert rel_err(y, ref) < 1e-5
    assert rel_err(cache[0][1, :, :9], ref_cache[0][1, :, :9]) < 1e-5
    assert torch.equal(cache[0][0], torch.zeros_like(cache[0][0]))  # the other slot untouched


@pytest.mark.parametrize("H, G", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("style", ["norm", "neox", None])
def test_step_attention_with_device_positions_matches_reference(H, G, style):
    """head_attention_step (slots and positions as tensors, rope rows gathered from the table):
    three sequences at different lengths, decoded token by token, equal the float64 reference,
    caches included, and a slot of no sequence stays untouched."""
    from powerinfer_ray.kernels import head_attention_step, rope_table

    gen = torch.Generator().manual_seed(11)
    hd, D, S, n_slots = 8, 32, 24, 4
    bias = style is None
    w = _weights(H, G, hd, D, torch.float32, gen, bias)
    wqkv = torch.cat([w["wq"], w["wk"], w["wv"]])
    bqkv = torch.cat([w["bq"], w["bk"], w["bv"]]) if bias else None
    n_rot = 6 if style == "neox" else hd
    cos_t, sin_t = rope_table(S, n_rot, 500.0, "cpu")
    hist = [torch.randn(n_slots, G, S, hd, generator=gen) for _ in range(2)]  # earlier tokens' K/V
    cache, ref_cache = [c.clone() for c in hist], [c.double() for c in hist]
    slots, pos = [3, 0, 1], [5, 0, 11]
    for _ in range(3):
        x = torch.randn(3, D, generator=gen)
        sl, ps = torch.tensor(slots), torch.tensor(pos)
        cos, sin = (cos_t[ps], sin_t[ps]) if style else (None, None)
        y = head_attention_step(x, wqkv, bqkv, w["wo_t"], cache[0], cache[1], sl, ps, cos, sin, style,
                                n_rot if style == "neox" else None)
        ref = head_attention_ref(x[:, None].double(), k_cache=ref_cache[0], v_cache=ref_cache[1], slots=slots,
                                 start_pos=pos, rope_theta=500.0, rope_style=style,
                                 n_rot=n_rot if style == "neox" else None, **{k: v.double() for k, v in w.items()})
        assert y.shape == (3, D)
        assert rel_err(y, ref[:, 0]) < 1e-5
        pos = [p + 1 for p in pos]
    assert rel_err(cache[0], ref_cache[0]) < 1e-5 and rel_err(cache[1], ref_cache[1]) < 1e-5
    assert torch.equal(cache[0][2], hist[0][2])  # slot 2 belongs to no sequence


@pytest.mark.parametrize("wdt", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("B, T", [(1, 1), (1, 5), (3, 2)], ids=["decode", "prefill", "batch"])
def test_cpu_executor_layout_fp32_x_with_weights_read_in_place(wdt, B, T):
    """The CPU executor's attention: fp32 x and KV cache, weights in the model's dtype with wo_t a
    transposed view of row-major [D, Hs*hd], projections by kernels.cpu_ffn.linear (the compiled
    kernel reading fp16 / bf16 rows in place) = the float64 reference on the same weights."""
    from powerinfer_ray.kernels.cpu_ffn import linear

    gen = torch.Generator().manual_seed(11)
    H, G, hd, D, S = 8, 2, 16, 80, 12
    w = _weights(H, G, hd, D, wdt, gen, bias=True)
    w["wo_t"] = w["wo_t"].T.contiguous().T  # the out_rows layout of runtime.shard.load_attn_shard
    assert w["wo_t"].T.is_contiguous() and not w["wo_t"].is_contiguous()
    x = torch.randn(B, T, D, generator=gen)
    cache = [torch.zeros(B + 1, G, S, hd) for _ in range(2)]
    ref_cache = [torch.zeros(B + 1, G, S, hd, dtype=torch.float64) for _ in range(2)]
    slots, start = list(range(1, B + 1)), [3 * b for b in range(B)]
    y = head_attention(x, k_cache=cache[0], v_cache=cache[1], slots=slots, start_pos=start, rope_style="norm",
                       linear=lambda a, m, b: linear(a, m, b, threads=2), **w)
    ref = head_attention_ref(x.double(), k_cache=ref_cache[0], v_cache=ref_cache[1], slots=slots,
                             start_pos=start, rope_style="norm", **{k: v.double() for k, v in w.items()})
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-5
    assert rel_err(cache[0], ref_cache[0]) < 1e-5


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("B, T", [(1, 1), (1, 5), (3, 2)], ids=["decode", "prefill", "batch"])
def test_quantized_projections_equal_rounded_float64(qtype, B, T):
    """Q8_0 / Q4_0 weights (q/k/v rows, wo_t the transposed view of the o-projection's blocks):
    head_attention and head_attention_step through the compiled CPU kernel, which quantizes each
    projection's input to Q8_0 as ggml does, equal float64 attention over the dequantized weights
    whose projections multiply the Q8_0-rounded inputs."""
    import torch.nn.functional as F

    from powerinfer_ray.kernels import dequantize, head_attention_step, round_q8_0
    from powerinfer_ray.kernels.cpu_ffn import linear
    from powerinfer_ray.model.quants import quantize

    gen = torch.Generator().manual_seed(13)
    H, G, hd, D, S = 4, 2, 32, 64, 12
    w = _weights(H, G, hd, D, torch.float32, gen, bias=True)
    q = {k: quantize(w[k], qtype) for k in ("wq", "wk", "wv")}
    q["wo_t"] = quantize(w["wo_t"].T, qtype).T  # [D, H*hd] rows as blocks, transposed view
    qw = dict(q, bq=w["bq"], bk=w["bk"], bv=w["bv"])
    ref_w = {k: dequantize(v, qtype, torch.float64) for k, v in q.items() if k != "wo_t"}
    ref_w["wo_t"] = dequantize(q["wo_t"].T, qtype, torch.float64).T
    ref_w.update({k: w[k].double() for k in ("bq", "bk", "bv")})
    rounded = lambda a, m, b: F.linear(round_q8_0(a), m, b)  # noqa: E731
    x = torch.randn(B, T, D, generator=gen)
    cache = [torch.zeros(B + 1, G, S, hd) for _ in range(2)]
    ref_cache = [torch.zeros(B + 1, G, S, hd, dtype=torch.float64) for _ in range(2)]
    slots, start = list(range(1, B + 1)), [3 * b for b in range(B)]
    y = head_attention(x, k_cache=cache[0], v_cache=cache[1], slots=slots, start_pos=start, rope_style="norm",
                       linear=lambda a, m, b, qtype: linear(a, m, b, threads=2, qtype=qtype), qtype=qtype, **qw)
    ref = head_attention(x.double(), k_cache=ref_cache[0], v_cache=ref_cache[1], slots=slots, start_pos=start,
                         rope_style="norm", linear=rounded, **ref_w)
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-5
    assert rel_err(cache[0], ref_cache[0]) < 1e-5
    if T == 1:  # the decode step's form (device positions; default linear: the same CPU kernel)
        sl, ps = torch.tensor(slots), torch.tensor(start) + 1
        y = head_attention_step(x[:, 0], torch.cat([q["wq"], q["wk"], q["wv"]]), torch.cat([w["bq"], w["bk"], w["bv"]]),
                                q["wo_t"], cache[0], cache[1], sl, ps, None, None, None, qtype=qtype)
        ref = head_attention(x.double(), k_cache=ref_cache[0], v_cache=ref_cache[1], slots=slots,
                             start_pos=ps.tolist(), rope_style=None, linear=rounded, **ref_w)
        assert rel_err(y, ref[:, 0]) < 1e-5
