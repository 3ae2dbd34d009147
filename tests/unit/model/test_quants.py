"""Q8_0 / Q4_0 blocks against gguf-py's own quantizer, quantized model files (ours, and upstream's
INT4 layout written by gguf-py itself), rows as blocks, planted quantized models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.planted import planted_model, write_planted_gguf
from powerinfer_ray.model.quants import QuantRows, dequantize, quantize
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import tiny_config, tiny_weights
from quant_models import k_blocks, write_upstream_int4

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}


def _awkward_rows(rng: np.random.Generator) -> np.ndarray:
    """[16, 256] float32: normal rows at several scales, and blocks that test the edge cases:
    all zero, ties of +-max (Q4_0 keeps the first), exact halves (Q8_0 rounds away from zero),
    large values, scales below f16's normal range."""
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[1] *= 1e-3
    x[2] *= 1e3
    x[3, :32] = 0.0
    x[4, :32] = np.where(np.arange(32) % 2, 1.0, -1.0)
    x[5, :32] = (np.arange(32) - 16) * (127 / 16) / 2 + 0.5  # halves once scaled
    x[6, :32] = rng.integers(-127, 128, 32) * np.float32(0.01)
    x[7] *= 1e4
    x[8] *= 1e-7
    x[9, 32:64] = 0.0
    x[9, 40] = -3.0
    return x


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_is_byte_exact_with_gguf(qtype, dtype):
    x = torch.from_numpy(_awkward_rows(np.random.default_rng(1))).to(dtype)
    ref = gq.quantize(x.float().numpy(), GGML[qtype])  # gguf-py's reference quantizer
    got = quantize(x, qtype)
    assert got.dtype == torch.uint8 and tuple(got.shape) == ref.shape
    np.testing.assert_array_equal(got.numpy(), ref)
    np.testing.assert_array_equal(dequantize(got, qtype).numpy(), gq.dequantize(ref, GGML[qtype]))
    rows = QuantRows(got, qtype)
    assert (rows.n_rows, rows.n_cols, rows.nbytes) == (16, 256, ref.size)


def test_block_layouts_by_hand():
    """One block each, solved by hand: Q8_0 d = 127/127 = 1, q = x; Q4_0 d = max / -8 with the
    first largest magnitude -4 -> d = 0.5, q = x / d + 8, low nibbles hold weights 0..15."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, -3.0, 2.5, -2.5])
    q8 = quantize(x, "q8_0")[0]
    assert q8[:2].view(torch.float16).item() == 1.0
    assert q8[2:6].view(torch.int8).tolist() == [127, -3, 3, -3]  # 2.5 -> 3, -2.5 -> -3
    y = torch.zeros(1, 32)
    y[0, 0], y[0, 1], y[0, 16], y[0, 17] = -4.0, 4.0, 1.0, -1.0
    q4 = quantize(y, "q4_0")[0]
    assert q4[:2].view(torch.float16).item() == 0.5
    # q = trunc(x / 0.5 + 8.5) clipped to 15: -4 -> 0, 4 -> 16 -> 15, 1 -> 10, -1 -> 6, 0 -> 8
    assert q4[2].item() == 0 | 10 << 4 and q4[3].item() == 15 | 6 << 4 and q4[4].item() == 8 | 8 << 4
    assert dequantize(q4[None], "q4_0")[0, :2].tolist() == [-4.0, 3.5]


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_model_file_bytes_equal_gguf_and_read_back(tmp_path, qtype):
    """Every matrix we write is gguf.quants.quantize of its float32 weights (output.weight at
    Q8_0 in a Q4_0 file, fc2 with rows of 8 at f16); reading dequantizes, rows come as blocks."""
    cfg = tiny_config("llama-reglu", dtype=qtype, predictor_rank=8, tied_output=False)
    weights = tiny_weights(cfg, seed=2)
    mf = ModelFile(write_model(tmp_path / "m.gguf", cfg, weights))
    assert mf.config == cfg
    for name, w in weights.items():
        kind = mf.dtype_of(name)
        if w.ndim == 1:
            assert kind == "f32" and torch.equal(mf.get(name), w.float()), name
        elif name.endswith("fc2.weight"):  # rows of 8 weights are not a block: f16
            assert kind == "f16" and torch.equal(mf.get(name), w.half()), name
        else:
            assert kind == ("q8_0" if name == "output.weight" else qtype), name
            ref = gq.quantize(w.float().numpy(), GGML[kind])
            np.testing.assert_array_equal(np.asarray(mf.raw(name)), ref, err_msg=name)
            np.testing.assert_array_equal(mf.get(name).numpy(), gq.dequantize(ref, GGML[kind]), err_msg=name)
    rows = [200, 3, 3, 17]
    blocks = mf.layer_blocks(K.FFN_DOWN_T, 1, rows=rows)
    assert mf.qtype(K.FFN_DOWN_T, 1) == blocks.qtype == qtype and mf.qtype(K.FC2, 0) is None
    np.testing.assert_array_equal(blocks.blocks.numpy(), np.asarray(mf.raw(K.tensor(K.FFN_DOWN_T, 1)))[rows])
    assert torch.equal(blocks.dequantize(), mf.layer(K.FFN_DOWN_T, 1, rows=rows))
    assert mf.qtype(K.OUTPUT) == ("q8_0" if qtype == "q4_0" else qtype)
    assert torch.equal(mf.global_blocks(K.TOKEN_EMBD, rows=[5]).dequantize(), mf.global_(K.TOKEN_EMBD)[5:6])


def test_q6_k_block_by_hand():
    """ql = 0x11 (both nibbles 1), qh = 0: every q = 1, x = d * scale * (1 - 32)."""
    b = np.zeros((1, 210), np.uint8)
    b[0, :128] = 0x11
    b[0, 192:208] = np.arange(16, dtype=np.int8).view(np.uint8)
    b[0, 208:210] = np.array([0.5], np.float16).view(np.uint8)
    x = dequantize(torch.from_numpy(b), "q6_k")[0]
    assert x.tolist() == [0.5 * (i // 16) * -31 for i in range(256)]


def test_upstream_int4_file_written_by_gguf_py_loads_and_generates(tmp_path):
    cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=64, tied_output=False,
                      norm_eps=1e-6, dtype="q4_0")
    path = tmp_path / "tiny.q4.powerinfer.gguf"
    want = write_upstream_int4(path, cfg, np.random.default_rng(7))
    mf = ModelFile(path)
    assert mf.magic == b"PWRI" and mf.config.dtype == "q4_0" and mf.config.ffn_act == "reglu"
    assert mf.config.predictor_ranks == (64, 64) and mf.dtype_of("output.weight") == "q6_k"
    assert mf.qtype(K.OUTPUT) is None and mf.qtype(K.FC1, 1) == mf.qtype(K.FFN_DOWN_T, 0) == "q4_0"
    for name, x in want.items():
        np.testing.assert_array_equal(mf.get(name).numpy(), x, err_msg=name)
    ref = ReferenceModel.from_file(mf)
    independent = ReferenceModel(mf.config, {n: torch.from_numpy(x) for n, x in want.items()})
    prompt = [1, 72, 101, 108, 108, 111]
    logits = ref.forward(prompt, ref.new_cache())
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(logits, independent.forward(prompt, independent.new_cache()))
    assert ref.generate_greedy(prompt, 8) == independent.generate_greedy(prompt, 8)


def test_quantized_rows_of_other_writers_layouts(tmp_path):
    """A fused attn_qkv hands out q/k/v rows as its blocks (a quantized untransposed ffn_down,
    whose neurons run across blocks, is refused: test_llama_cpp_gguf)."""
    cfg = tiny_config("falcon", dtype="q4_0")
    weights = tiny_weights(cfg, seed=4)
    fused = {}
    for name, t in weights.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k", "attn_v"):
            l = int(parts[1])
            if parts[2] == "attn_q":
                fused[K.tensor(K.ATTN_QKV, l)] = torch.cat([weights[K.tensor(t_, l)] for t_ in (K.ATTN_Q, K.ATTN_K, K.ATTN_V)])
        else:
            fused[name] = t
    mf = ModelFile(write_model(tmp_path / "f.gguf", cfg, fused, validate=False))
    q_rows, rows = cfg.n_head * cfg.head_dim, [1, 10, 5]
    qkv = np.asarray(mf.raw(K.tensor(K.ATTN_QKV, 1)))
    assert mf.qtype(K.ATTN_K, 1) == "q4_0"
    np.testing.assert_array_equal(mf.layer_blocks(K.ATTN_K, 1, rows=rows).blocks.numpy(), qkv[[q_rows + r for r in rows]])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_planted_quantized_from_the_generated_floats(tmp_path, qtype):
    """planted:<preset>?dtype=q4_0 is the f32 planted model quantized per block (bytes equal
    gguf's quantizer over the same floats), row subsets included, and its file holds the same
    blocks; its dense forward keeps the planted activation statistics."""
    f32, q = planted_model("tiny?dtype=f32"), planted_model(f"tiny?dtype={qtype}")
    assert q.config.dtype == qtype
    for tmpl, l in ((K.FFN_GATE, 1), (K.FFN_DOWN_T, 3), (K.ATTN_Q, 0), (K.FC1, 2)):
        ref = gq.quantize(f32.layer(tmpl, l).numpy(), GGML[qtype])
        rows = [len(ref) - 1, 7, 7, 0]
        np.testing.assert_array_equal(q.layer_blocks(tmpl, l).blocks.numpy(), ref, err_msg=tmpl)
        np.testing.assert_array_equal(q.layer_blocks(tmpl, l, rows=rows).blocks.numpy(), ref[rows], err_msg=tmpl)
        np.testing.assert_array_equal(q.layer(tmpl, l, rows=rows).numpy(), gq.dequantize(ref[rows], GGML[qtype]))
    mf = ModelFile(write_planted_gguf(q, tmp_path / "p.gguf", progress=False, stats_dir=tmp_path / "act"))
    for name in (K.tensor(K.FFN_UP, 2), K.global_tensor(K.TOKEN_EMBD), K.tensor(K.FC2, 0)):
        np.testing.assert_array_equal(np.asarray(mf.raw(name)), q.blocks(name).blocks.numpy(), err_msg=name)
    tokens = list(range(3, 3 + 96))
    shares = {}
    for name, m in (("f32", f32), (qtype, q)):
        hooks = _ActiveShare()
        ref = m.reference()
        ref.forward(tokens, ref.new_cache(), hooks)
        shares[name] = np.array(hooks.share)
    tol = 0.002 if qtype == "q8_0" else 0.01
    np.testing.assert_allclose(shares[qtype], shares["f32"], atol=tol)


class _ActiveShare:
    """Per layer, the share of FFN neurons the dense forward finds active."""

    def __init__(self) -> None:
        self.share: list[float] = []

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        self.share.append(float((h != 0).float().mean()))
