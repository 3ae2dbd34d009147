"""Standard llama.cpp GGUF files (arch llama / qwen2, ``ffn_down`` not transposed), written here the
way llama.cpp's convert_hf_to_gguf.py writes them (gguf-py's own tensor-name map, its Q/K permutation
for llama, nothing else touched), read by ModelFile and checked against HF transformers."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from test_convert_hf import L, assert_parity, llama, qwen2, randomize  # noqa: E402

from powerinfer_ray.model import gguf_keys as K  # noqa: E402
from powerinfer_ray.model.gguf_file import ModelFile, ModelFileError  # noqa: E402

VOCAB = 300
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_llama_cpp(model: torch.nn.Module, path, arch: str, ftype: str = "f32", down_q8: bool = False) -> None:
    """What llama.cpp writes for this HF model: general + {arch}.* metadata, tensors renamed by
    gguf.get_tensor_name_map, matrices at ``ftype`` (norms and biases f32), no tied head."""
    c = model.config
    H, G = c.num_attention_heads, c.num_key_value_heads
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCHS[arch]])
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(c.hidden_size // H)
    names = gguf.get_tensor_name_map(ARCHS[arch], c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, H, H)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, H, G)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if down_q8 and name.endswith("ffn_down.weight"):
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif data.ndim == 2 and ftype == "f16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_model(arch: str, **kw) -> torch.nn.Module:
    m = llama("silu", vocab_size=VOCAB, num_key_value_heads=2, **kw) if arch == "llama" else qwen2(vocab_size=VOCAB, **kw)
    m.config._attn_implementation = "eager"
    randomize(m, seed=5)
    return m.eval()


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_llama_cpp_file_matches_hf(tmp_path, arch, tied):
    model = hf_model(arch, tie_word_embeddings=tied)
    write_llama_cpp(model, tmp_path / "m.gguf", arch)
    mf = ModelFile(tmp_path / "m.gguf")
    c = mf.config
    assert (c.arch, c.ffn_act, c.n_head_kv, c.tied_output, c.qkv_bias) == (arch, "swiglu", 2, tied, arch == "qwen2")
    assert K.tensor(K.FFN_DOWN, 0) in mf.tensors and K.tensor(K.FFN_DOWN_T, 0) not in mf.tensors
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_parity(model, mf, prompt)


def test_standard_down_rows_are_its_columns_at_f16(tmp_path):
    """ffn_down [D, F] read as ffn_down_t: neuron j's row is column j, for any subset of neurons."""
    model = hf_model("qwen2")
    write_llama_cpp(model, tmp_path / "m.gguf", "qwen2", ftype="f16")
    mf = ModelFile(tmp_path / "m.gguf")
    ids = [5, 0, 77, 127]
    for l in range(L):
        down = model.model.layers[l].mlp.down_proj.weight.detach()  # [D, F]
        got = mf.layer(K.FFN_DOWN_T, l, rows=ids)
        assert got.dtype == torch.float16 and got.shape == (len(ids), down.shape[0])
        torch.testing.assert_close(got, down[:, ids].T.half(), rtol=0, atol=0)


def test_quantized_standard_down_is_refused_with_the_way_out(tmp_path):
    write_llama_cpp(hf_model("llama"), tmp_path / "q.gguf", "llama", down_q8=True)
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.ffn_down.weight' is Q8_0 in llama.cpp's layout "
                                             r".* convert the HF checkpoint with `powerinfer-ray convert`"):
        ModelFile(tmp_path / "q.gguf")
