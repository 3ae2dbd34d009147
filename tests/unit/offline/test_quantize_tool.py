"""`powerinfer-ray convert --outtype q8_0|q4_0` and `powerinfer-ray quantize IN OUT q8_0|q4_0`,
through the command line, against gguf-py's own quantizer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from test_convert_hf import save_hf, write_predictors
from quant_models import write_upstream_int4

from powerinfer_ray.cli import main
from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile, ModelFileError, open_gguf
from powerinfer_ray.model.gguf_writer import write_model
from powerinfer_ray.model.tiny import tiny_config, tiny_weights
from powerinfer_ray.offline.hf_archs import permute_qk

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}


def _assert_quantized(mf: ModelFile, name: str, weights: torch.Tensor, kind: str) -> None:
    assert mf.dtype_of(name) == kind, name
    np.testing.assert_array_equal(np.asarray(mf.raw(name)), gq.quantize(weights.detach().float().numpy(), GGML[kind]),
                                  err_msg=name)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_convert_outtype_quantizes_every_matrix_and_the_predictors(tmp_path, qtype, capsys):
    hf_model = save_hf("llama-relu", tmp_path / "hf")
    sds = write_predictors(tmp_path / "pred", [32, 64])
    out = tmp_path / "m.gguf"
    assert main(["convert", str(tmp_path / "hf"), "-o", str(out), "--outtype", qtype,
                 "--predictors", str(tmp_path / "pred")]) == 0
    mf = ModelFile(out)
    assert mf.config.dtype == qtype and mf.magic == K.PWRI_MAGIC
    assert mf.meta(K.FILE_TYPE) == {"q8_0": 7, "q4_0": 2}[qtype]  # llama.cpp's LlamaFileType
    layer = hf_model.model.layers[1]
    _assert_quantized(mf, K.tensor(K.FFN_UP, 1), layer.mlp.up_proj.weight, qtype)
    _assert_quantized(mf, K.tensor(K.FFN_DOWN_T, 1), layer.mlp.down_proj.weight.T, qtype)
    _assert_quantized(mf, K.tensor(K.ATTN_K, 1), permute_qk(layer.self_attn.k_proj.weight, 4), qtype)
    _assert_quantized(mf, K.global_tensor(K.TOKEN_EMBD), hf_model.model.embed_tokens.weight, qtype)
    _assert_quantized(mf, K.global_tensor(K.OUTPUT), hf_model.lm_head.weight, "q8_0")  # upstream: Q6_K
    for l, sd in enumerate(sds):  # predictors as upstream quantizes them: like the model
        _assert_quantized(mf, K.tensor(K.FC1, l), sd["fc1.weight"], qtype)
        _assert_quantized(mf, K.tensor(K.FC2, l), sd["fc2.weight"], qtype)
    assert mf.dtype_of(K.tensor(K.FFN_NORM, 0)) == "f32"


def test_quantize_tool_streams_a_file_tensor_by_tensor(tmp_path, capsys):
    """An f16 PWRI model -> q4_0: matrices as gguf quantizes their f16 values (rows of 8 stay
    f16), the rest and every metadata key as they were, the magic kept, a progress bar."""
    cfg = tiny_config("llama-reglu", dtype="f16", predictor_rank=8, tied_output=False)
    src = write_model(tmp_path / "m.f16.gguf", cfg, tiny_weights(cfg, seed=3),
                      metadata={"some.array": [1.5, 2.5], "some.count": 7})
    dst = tmp_path / "m.q4.gguf"
    assert main(["quantize", str(src), str(dst), "q4_0"]) == 0
    assert "writing" in capsys.readouterr().err  # tqdm's bar
    a, b = ModelFile(src), ModelFile(dst)
    assert b.magic == K.PWRI_MAGIC and b.config == a.config.with_(dtype="q4_0")
    assert {k: v for k, v in b.fields.items() if k != K.FILE_TYPE} == {k: v for k, v in a.fields.items()
                                                                        if k != K.FILE_TYPE}
    for name in a.tensors:
        kind = b.dtype_of(name)
        if name.endswith("fc2.weight") or len(a.shape(name)) == 1:
            assert kind == a.dtype_of(name) and np.array_equal(np.asarray(b.raw(name)), np.asarray(a.raw(name)))
        else:
            _assert_quantized(b, name, a.get(name), "q8_0" if name == "output.weight" else "q4_0")
    # the same file as writing the model at q4_0 directly
    direct = ModelFile(write_model(tmp_path / "d.gguf", a.config.with_(dtype="q4_0"),
                                   {n: a.get(n) for n in a.tensors}))
    assert all(np.array_equal(np.asarray(direct.raw(n)), np.asarray(b.raw(n))) for n in a.tensors)


def test_quantize_tool_keeps_blocks_and_requantizes_other_types(tmp_path, caplog):
    """Upstream's INT4 file with one Q4_K matrix, which the runtime refuses: `quantize ... q4_0`
    keeps the Q4_0 blocks byte for byte and re-quantizes Q4_K and Q6_K from their dequantized
    weights (saying so); `... q8_0` re-quantizes everything."""
    cfg = tiny_config("llama-reglu", n_embd=256, n_ff=256, predictor_rank=64, tied_output=False, dtype="q4_0")
    src = tmp_path / "up.q4.gguf"
    want = write_upstream_int4(src, cfg, np.random.default_rng(3), q4_k=(K.tensor(K.FFN_UP, 1),))
    with pytest.raises(ModelFileError, match="Q4_K.*powerinfer-ray quantize"):
        ModelFile(src)
    raw = {t.name: np.asarray(t.data) for t in open_gguf(src).tensors}
    for qtype in ("q4_0", "q8_0"):
        dst = tmp_path / f"out.{qtype}.gguf"
        assert main(["quantize", str(src), str(dst), qtype]) == 0
        assert "quantized again" in caplog.text
        b = ModelFile(dst)
        for name, x in want.items():
            kind = b.dtype_of(name)
            if x.ndim == 1:
                assert kind == "f32" and np.array_equal(b.get(name).numpy(), x)
            elif qtype == "q4_0" and name not in ("output.weight", K.tensor(K.FFN_UP, 1)):
                assert kind == "q4_0" and np.array_equal(np.asarray(b.raw(name)), raw[name]), name  # kept
            else:
                _assert_quantized(b, name, torch.from_numpy(x), "q8_0" if name == "output.weight" else qtype)


def test_quantization_quality_of_the_embedded_model(tmp_path):
    """Issue 19's bar on the embedded tiny model's held-out text (a sample of it here; all of it in
    bench/results/quant-quality-tiny.json): Q8_0 perplexity within 0.5 % of the f16 file's, Q4_0
    within a few % and mostly the same next token."""
    from powerinfer_ray.model.default import default_model_path
    from powerinfer_ray.offline.quantize import quantization_quality, quantize_file

    src = default_model_path()
    q8 = quantization_quality(src, quantize_file(src, tmp_path / "q8.gguf", "q8_0", progress=False), max_tokens=512)
    q4 = quantization_quality(src, quantize_file(src, tmp_path / "q4.gguf", "q4_0", progress=False), max_tokens=512)
    assert q8["tokens"] == q4["tokens"] == 512 and q8["ppl_reference"] == q4["ppl_reference"]
    assert abs(q8["ppl_ratio"] - 1) < 0.005 and q8["top1_agreement"] > 0.97, q8
    assert 1.0 < q4["ppl_ratio"] < 1.06 and q4["top1_agreement"] > 0.8, q4
