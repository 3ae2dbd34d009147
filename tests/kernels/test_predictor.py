"""Predictor logits and the GPU/CPU split of active neurons (exact and packed forms)."""
from __future__ import annotations

import pytest
import torch

from powerinfer_ray.kernels import (local_index, packed_views, predictor_logits, predictor_logits_ref, sparse_ffn,
                                    sparse_ffn_ref, split_active, split_active_packed, unpack_active)

from kernel_checks import TOL, make_shard, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_predictor_logits_match_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    fc1 = (torch.randn(16, 64, generator=gen) / 8).to(dtype)
    fc2 = (torch.randn(300, 16, generator=gen) / 4).to(dtype)
    out = predictor_logits(x, fc1, fc2)
    assert out.shape == (5, 300) and out.dtype == dtype
    assert rel_err(out, predictor_logits_ref(x, fc1, fc2)) < TOL[dtype]


def test_predictor_logits_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="fc2"):
        predictor_logits(torch.randn(1, 8), torch.randn(4, 8), torch.randn(10, 5))


def test_split_active_by_hand():
    # 2 tokens, 6 neurons; neurons 0, 2, 4 on the GPU. Active iff logit >= 0.5 (equal counts).
    logits = torch.tensor([[0.5, 0.0, 0.9, 0.2, 0.0, 1.0],
                           [0.0, 0.0, 0.7, 0.6, 0.1, 0.4]])
    gpu = torch.tensor([True, False, True, False, True, False])
    s = split_active(logits, 0.5, gpu)
    assert s.gpu_idx.tolist() == [0, 2]
    assert s.gpu_tok_mask.tolist() == [[True, True], [False, True]]
    assert s.cpu_idx.tolist() == [3, 5]
    assert s.cpu_tok_mask.tolist() == [[False, True], [True, False]]
    local = split_active(logits, 0.5, gpu, local_index(gpu))
    assert local.gpu_idx.tolist() == [0, 1] and local.cpu_idx.tolist() == [1, 2]


def test_local_index_numbers_each_part_in_order():
    gpu = torch.tensor([False, True, True, False, False, True])
    assert local_index(gpu).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("T", [1, 7, 32])
@pytest.mark.parametrize("with_local", [False, True])
def test_packed_split_equals_exact_split(T, with_local):
    gen = torch.Generator().manual_seed(T)
    N = 2000
    logits = (torch.randn(T, N, generator=gen) - 1.5).half()
    gpu = torch.rand(N, generator=gen) < 0.3
    loc = local_index(gpu) if with_local else None
    exact = split_active(logits, 0.0, gpu, loc)
    packed = split_active_packed(logits, 0.0, gpu, local_of=loc, gpu_capacity=int(gpu.sum()),
                                 cpu_capacity=int((~gpu).sum()))
    for part, (idx, tok) in zip(packed, [(exact.gpu_idx, exact.gpu_tok_mask), (exact.cpu_idx, exact.cpu_tok_mask)]):
        assert part.dtype == torch.int32 and part.is_contiguous()
        got_idx, got_tok = unpack_active(part, T)
        assert torch.equal(got_idx, idx) and torch.equal(got_tok, tok)


def test_packed_capacity_overflow_keeps_the_first_ids_and_the_true_count():
    logits = torch.ones(1, 10)
    gpu = torch.zeros(10, dtype=torch.bool)
    packed = split_active_packed(logits, 0.0, gpu, gpu_capacity=2, cpu_capacity=4)
    idx, bits, count = packed_views(packed.cpu)
    assert int(count) == 10 and idx.tolist() == [0, 1, 2, 3] and bits.tolist() == [1] * 4
    assert int(packed_views(packed.gpu)[2]) == 0


def test_packed_views_feed_sparse_ffn_directly():
    """Predictor -> packed split -> sparse_ffn on each device's shard equals the dense masked FFN."""
    gen = torch.Generator().manual_seed(1)
    N, D, T = 256, 64, 4
    up, gate, down_t, _ = make_shard(N, D, torch.float32, "reglu", False, gen)
    x = torch.randn(T, D, generator=gen)
    logits = torch.randn(T, N, generator=gen) - 1.0
    gpu = torch.rand(N, generator=gen) < 0.4
    shards = [gpu.nonzero().squeeze(1), (~gpu).nonzero().squeeze(1)]  # global rows in ascending order
    packed = split_active_packed(logits, 0.0, gpu, local_of=local_index(gpu), gpu_capacity=len(shards[0]),
                                 cpu_capacity=len(shards[1]))
    y = torch.zeros(T, D)
    for part, rows in zip(packed, shards):
        idx, bits, count = packed_views(part)
        y += sparse_ffn(x, up[rows], gate[rows], down_t[rows], idx, bits, n_active=count)
    active = logits >= 0.0  # [T, N]
    ref = sparse_ffn_ref(x, up, gate, down_t, torch.arange(N), active)
    assert rel_err(y, ref) < 1e-5


def test_packed_split_rejects_more_than_32_tokens():
    with pytest.raises(ValueError, match="T is 33"):
        split_active_packed(torch.zeros(33, 4), 0.0, torch.zeros(4, dtype=torch.bool))


@pytest.mark.parametrize("T, N, col0, n", [(1, 13, 0, 13), (3, 101, 7, 90), (5, 64, 60, 4), (2, 40, 40, 0)])
def test_pack_active_bits_matches_numpy_packbits(T, N, col0, n):
    """Threshold + pack 8 neurons a byte (little bit order) equals numpy's packbits of the
    thresholded slice; unpack_mask (the CPU executor's side) inverts it."""
    import numpy as np

    from powerinfer_ray.kernels.predictor import pack_active_bits
    from powerinfer_ray.runtime.channel import unpack_mask

    gen = torch.Generator().manual_seed(T * N + col0)
    logits = torch.randn(T, N, generator=gen)
    want = np.packbits((logits[:, col0:col0 + n] >= 0.25).numpy(), axis=1, bitorder="little")
    got = pack_active_bits(logits, 0.25, col0, n)
    assert got.dtype == torch.uint8 and got.shape == (T, (n + 7) // 8)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(unpack_mask(got.numpy(), n), logits[:, col0:col0 + n] >= 0.25)
    with pytest.raises(ValueError, match="outside"):
        pack_active_bits(logits, 0.0, col0, N - col0 + 1)
