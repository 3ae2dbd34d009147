"""GGUF I/O: round trips, PWRI files, lazy row access, and one clear error per kind of bad file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.config import ModelConfig
from powerinfer_ray.model.gguf_file import ModelFile, ModelFileError
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import VARIANTS, tiny_config, tiny_weights, write_tiny_model
from powerinfer_ray.model.tokenizer import Tokenizer, byte_level_fields


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_round_trip_weights_and_metadata(tmp_path, variant, dtype):
    cfg = tiny_config(variant, dtype=dtype, predictor_rank=8)
    weights = tiny_weights(cfg, seed=3)
    path = write_model(tmp_path / "m.gguf", cfg, weights, metadata=byte_level_fields())
    mf = ModelFile(path)
    assert mf.config == cfg
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    for name, w in weights.items():
        got = mf.get(name)
        want = w.to(tdt) if w.ndim >= 2 else w.float()  # 1-D tensors are stored as F32
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), name
    assert mf.fields[K.TOK_TOKENS] == byte_level_fields()[K.TOK_TOKENS]


def test_sparse_model_is_stamped_pwri_and_dense_model_is_not(tmp_path):
    sparse = write_tiny_model(tmp_path / "s.gguf", predictor_rank=8)
    dense = write_tiny_model(tmp_path / "d.gguf")
    unstamped = write_tiny_model(tmp_path / "u.gguf", predictor_rank=8, sparse=False)
    assert sparse.read_bytes()[:4] == b"PWRI"
    assert dense.read_bytes()[:4] == b"GGUF"
    assert unstamped.read_bytes()[:4] == b"GGUF"
    for p in (sparse, unstamped):
        mf = ModelFile(p)
        assert mf.is_sparse and mf.config.predictor_ranks == (8, 8)
        assert mf.config.sparse_threshold == 0.0


def test_pwri_file_written_by_plain_gguf_writer_reads(tmp_path):
    """An upstream-style file: the gguf package's writer, then the magic patched to PWRI."""
    path = tmp_path / "upstream.gguf"
    w = GGUFWriter(path, "llama")
    cfg = tiny_config("llama-reglu", n_layer=1)
    for k, v in {K.key(K.BLOCK_COUNT, "llama"): 1, K.key(K.EMBEDDING_LENGTH, "llama"): cfg.n_embd,
                 K.key(K.FEED_FORWARD_LENGTH, "llama"): cfg.n_ff, K.key(K.HEAD_COUNT, "llama"): 4,
                 K.key(K.CONTEXT_LENGTH, "llama"): 128}.items():
        w.add_uint32(k, v)
    w.add_float32(K.key(K.LAYERNORM_RMS_EPS, "llama"), 1e-5)
    weights = tiny_weights(cfg.with_(n_vocab=258))
    for name, t in weights.items():
        w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with path.open("r+b") as fh:
        fh.write(b"PWRI")
    mf = ModelFile(path)
    assert mf.magic == b"PWRI" and mf.config.ffn_act == "reglu"  # sparse llama defaults to ReGLU
    assert torch.equal(mf.layer(K.FFN_UP, 0), weights[K.tensor(K.FFN_UP, 0)])


def test_lazy_row_access_matches_full_tensor(tmp_path):
    cfg = tiny_config("llama-gqa", dtype="f16")
    weights = tiny_weights(cfg)
    mf = ModelFile(write_model(tmp_path / "m.gguf", cfg, weights))
    rows = [7, 3, 200, 3]
    full = weights[K.tensor(K.FFN_DOWN_T, 1)].half()
    assert torch.equal(mf.layer(K.FFN_DOWN_T, 1, rows=rows), full[rows])
    raw = mf.raw(K.tensor(K.FFN_UP, 0))  # no copy until asked: a view of the file's map
    assert isinstance(mf.reader.data, np.memmap) and np.shares_memory(raw, mf.reader.data)
    assert not raw.flags.writeable


def test_standard_ffn_down_and_fused_qkv_layouts_are_read(tmp_path):
    """llama.cpp-style files store ffn_down [D, F] (not transposed) and falcon's fused attn_qkv."""
    cfg = tiny_config("falcon-gqa")
    weights = tiny_weights(cfg)
    alt = {}
    for name, t in weights.items():
        if ".ffn_down_t." in name:
            alt[name.replace("ffn_down_t", "ffn_down")] = t.T.contiguous()
        elif ".attn_q.weight" in name:
            l = int(name.split(".")[1])
            alt[K.tensor(K.ATTN_QKV, l)] = torch.cat([weights[K.tensor(x, l)] for x in (K.ATTN_Q, K.ATTN_K, K.ATTN_V)])
        elif ".attn_k." in name or ".attn_v." in name:
            continue
        else:
            alt[name] = t
    path = write_model(tmp_path / "alt.gguf", cfg, alt, validate=False)
    mf = ModelFile(path)
    for l in range(cfg.n_layer):
        for tmpl in (K.ATTN_Q, K.ATTN_K, K.ATTN_V, K.FFN_DOWN_T):
            assert torch.equal(mf.layer(tmpl, l), weights[K.tensor(tmpl, l)]), (tmpl, l)
    ref = ReferenceModel(cfg, weights)
    got = ReferenceModel.from_file(mf)
    toks = [1, 5, 9, 77]
    torch.testing.assert_close(got.forward(toks, got.new_cache()), ref.forward(toks, ref.new_cache()))


def test_tokenizer_metadata_round_trip(tmp_path):
    mf = ModelFile(write_tiny_model(tmp_path / "m.gguf"))
    tok = Tokenizer(mf.fields)
    text = "Hello, wörld!\n  tabs\tand ünïcödé ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text


# ------------------------------------------------------------------------------------------------
# bad files: one clear error naming the file and the problem
# ------------------------------------------------------------------------------------------------
def _assert_clear(exc: pytest.ExceptionInfo, path, *words: str) -> None:
    msg = str(exc.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    assert "Traceback" not in msg


def test_truncated_file(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as exc:
            ModelFile(bad)
        _assert_clear(exc, bad)
        assert "truncated" in str(exc.value)


def test_wrong_magic(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + write_tiny_model(tmp_path / "m.gguf").read_bytes()[4:])
    with pytest.raises(ModelFileError) as exc:
        ModelFile(path)
    _assert_clear(exc, path, "magic", "NOPE")


def test_missing_tensor(tmp_path):
    cfg = tiny_config("llama-reglu")
    weights = tiny_weights(cfg)
    del weights[K.tensor(K.FFN_GATE, 1)]
    path = write_model(tmp_path / "m.gguf", cfg, weights, validate=False)
    with pytest.raises(ModelFileError) as exc:
        ModelFile(path)
    _assert_clear(exc, path, "missing tensor", "blk.1.ffn_gate.weight")
    with pytest.raises(ModelFileError):  # the writer refuses it too
        write_model(tmp_path / "n.gguf", cfg, weights)


def test_shape_contradicting_metadata(tmp_path):
    cfg = tiny_config("llama-reglu")
    weights = tiny_weights(cfg)
    weights[K.tensor(K.FFN_UP, 0)] = torch.zeros(cfg.n_ff + 1, cfg.n_embd)
    path = write_model(tmp_path / "m.gguf", cfg, weights, validate=False)
    with pytest.raises(ModelFileError) as exc:
        ModelFile(path)
    _assert_clear(exc, path, "blk.0.ffn_up.weight", str([cfg.n_ff + 1, cfg.n_embd]), str([cfg.n_ff, cfg.n_embd]))


def test_unknown_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path, "mamba")
    w.add_uint32("mamba.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFileError) as exc:
        ModelFile(path)
    _assert_clear(exc, path, "unknown architecture", "mamba")


@pytest.mark.parametrize("type_name, name", [("Q4_K", "blk.0.ffn_up.weight"), ("IQ2_XXS", "token_embd.weight"),
                                             ("Q6_K", "blk.0.attn_q.weight")])
def test_unsupported_tensor_type_is_one_line_naming_tensor_type_and_conversion(tmp_path, type_name, name):
    """K-quants (but Q6_K for output.weight) and IQ types: one line naming the tensor and the
    type, and the command that converts the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qt]
    path = tmp_path / "q.gguf"
    w = GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.add_tensor(name, np.zeros((4, size), np.uint8), raw_dtype=qt)  # 4 rows of 256 weights
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFileError) as exc:
        ModelFile(path)
    _assert_clear(exc, path, name, type_name, "powerinfer-ray quantize", "q4_0")
    assert "\n" not in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError) as exc:
        ModelFile(tmp_path / "nope.gguf")
    _assert_clear(exc, tmp_path / "nope.gguf", "no such file")


def test_config_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="n_head_kv"):
        ModelConfig(arch="llama", ffn_act="reglu", n_vocab=10, n_embd=64, n_layer=1, n_head=4,
                    n_head_kv=3, n_ff=8, n_ctx=8)
    with pytest.raises(ValueError, match="ffn_act"):
        ModelConfig(arch="llama", ffn_act="gelu", n_vocab=10, n_embd=64, n_layer=1, n_head=4,
                    n_head_kv=4, n_ff=8, n_ctx=8)


def test_reader_is_gguf_compatible(tmp_path):
    """Files we write (GGUF magic) open with the gguf package's own reader, tensors in order."""
    path = write_tiny_model(tmp_path / "m.gguf")
    r = GGUFReader(path)
    names = [t.name for t in r.tensors]
    assert names[0] == "token_embd.weight"
    assert K.tensor(K.FFN_DOWN_T, 0) in names


def test_layer_rows_copies_rows_and_sends_runs_from_the_map(tmp_path):
    """layer_rows: on the CPU a copy of the rows (all, a run, any order), converted; to another
    device a run or all rows go straight from the map (here the meta device: shape and dtype)."""
    from powerinfer_ray.model.source import layer_rows, open_model

    cfg = tiny_config("llama-gqa", dtype="f16")
    weights = tiny_weights(cfg)
    src = open_model(str(write_model(tmp_path / "m.gguf", cfg, weights)))
    full = weights[K.tensor(K.FFN_UP, 1)].half()
    raw = src.raw(K.tensor(K.FFN_UP, 1))
    for rows in (None, range(4, 9), [9, 3, 4]):
        want = full if rows is None else full[list(rows)]
        got = layer_rows(src, K.FFN_UP, 1, rows=rows, dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, want.float())
        assert not np.shares_memory(got.numpy(), raw)  # a copy: the map's pages are read-only
        meta = layer_rows(src, K.FFN_UP, 1, rows=rows, dtype=torch.float32, device="meta")
        assert meta.is_meta and meta.dtype == torch.float32 and meta.shape == want.shape


def test_reader_parses_arrays_as_gguf_does(tmp_path):
    """The reader's one-pass arrays (strings, numbers, empty strings, unicode) give every field the
    contents, item access and types gguf's own parsing gives, for a written file."""
    from gguf import GGUFReader

    from powerinfer_ray.model.gguf_file import _Reader

    class Stock(_Reader):  # the same reader with gguf's field parsing
        _get_field_parts = GGUFReader._get_field_parts

    path = tmp_path / "a.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["", "a", "héllo ▁wörld", "x" * 300] * 50)
    w.add_array("t.ints", list(range(-5, 995)))
    w.add_array("t.floats", [0.5 * i for i in range(77)])
    w.add_array("t.empty", [])
    w.add_string("t.name", "tiny")
    w.add_uint32("t.n", 7)
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fast, stock = _Reader(path), Stock(path)
    assert list(fast.fields) == list(stock.fields)
    for name, f in stock.fields.items():
        g = fast.fields[name]
        assert g.contents() == f.contents() and g.types == f.types and len(g.data) == len(f.data), name
        if len(f.data) > 3:
            assert g.contents(3) == f.contents(3) and g.contents(slice(1, 4)) == f.contents(slice(1, 4)), name
    assert fast.fields["t.strings"].contents()[2] == "héllo ▁wörld"
    assert np.array_equal(fast.tensors[0].data, stock.tensors[0].data)
