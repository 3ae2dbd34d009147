"""HF -> GGUF conversion, checked against HF transformers' own forward pass.

Random tiny HF models (every parameter randomised, norms and biases included, so that a swapped
norm or a wrong head order shows) are saved with save_pretrained (safetensors) next to a real
trained tokenizer, converted at f32, loaded with ReferenceModel, and compared with HF in fp32:
prefill logits and 16 greedy decode steps within 1e-4 relative, greedy tokens equal.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import pydoc_data.topics
import torch
from safetensors.torch import load_file, save_file
from ties import TIE  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

transformers = pytest.importorskip("transformers")
from transformers import (AutoTokenizer, FalconConfig, FalconForCausalLM, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, OPTConfig, OPTForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from powerinfer_ray.model import gguf_keys as K  # noqa: E402
from powerinfer_ray.model.gguf_file import ModelFile  # noqa: E402
from powerinfer_ray.model.reference import ReferenceModel  # noqa: E402
from powerinfer_ray.model.tokenizer import SPM, Tokenizer  # noqa: E402
from powerinfer_ray.model.gguf_writer import LazyTensor  # noqa: E402
from powerinfer_ray.offline.convert import convert_hf, predictor_files  # noqa: E402
from powerinfer_ray.offline.hf_archs import (_context_length, falcon_qkv_layout, permute_qk,  # noqa: E402
                                             planner_for, rope_theta)
from powerinfer_ray.offline.hf_checkpoint import Checkpoint, ConvertError, HFConfig  # noqa: E402

D, L, F, CTX = 64, 2, 128, 128
N_DECODE = 16
REL_TOL = 1e-4
PROMPT = "The quick brown fox: 12 + 30 = 42.\n  Déjà vu? 日本"
CORPUS = list(pydoc_data.topics.topics.values())[:30]
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# ------------------------------------------------------------------------------------------------
# fixtures: tokenizers and random HF models
# ------------------------------------------------------------------------------------------------
def byte_level_tokenizer(out: Path) -> int:
    """A trained GPT-2 style BPE saved into ``out``; returns its size."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>")
    hf.chat_template = CHAT
    hf.save_pretrained(out)
    return len(hf)


def spm_tokenizer(out: Path) -> int:
    """A trained Llama-style BPE (byte fallback, "▁", BOS added) saved into ``out``."""
    base = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM, prepend_scheme="first")
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=80, show_progress=False))
    spec = json.loads(base.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in spec["model"]["merges"]],
                                 unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPM, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(out)
    return len(hf)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights
    ~ 1 + N(0, 0.2), biases ~ N(0, 0.1) (HF's init leaves norms at 1 and biases at 0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if name.endswith("bias"):
            p.copy_(0.1 * r)
        elif p.dim() == 1:
            p.copy_(1.0 + 0.2 * r)
        elif "embed" in name:
            p.copy_(r)
        else:
            p.copy_(r / p.shape[1] ** 0.5)


def llama(act: str = "relu", **kw) -> LlamaForCausalLM:
    cfg = LlamaConfig(hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=4,
                      hidden_act=act, max_position_embeddings=CTX, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **kw)
    return LlamaForCausalLM(cfg)


def qwen2(**kw) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=CTX, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **kw)
    return Qwen2ForCausalLM(cfg)


def mistral(**kw) -> MistralForCausalLM:
    cfg = MistralConfig(hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=CTX, rms_norm_eps=1e-6,
                        sliding_window=None, **kw)
    return MistralForCausalLM(cfg)


def opt(**kw) -> OPTForCausalLM:
    cfg = OPTConfig(hidden_size=D, ffn_dim=F, num_hidden_layers=L, num_attention_heads=4,
                    max_position_embeddings=CTX, word_embed_proj_dim=D, activation_function="relu",
                    dropout=0.0, **kw)
    return OPTForCausalLM(cfg)


def falcon(**kw) -> FalconForCausalLM:
    cfg = FalconConfig(hidden_size=D, num_hidden_layers=L, num_attention_heads=4, ffn_hidden_size=F,
                       activation="relu", max_position_embeddings=CTX, **kw)
    return FalconForCausalLM(cfg)


MODELS = {
    "llama-relu": lambda v: llama("relu", vocab_size=v),
    "llama-gqa-tied": lambda v: llama("relu", vocab_size=v, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-silu": lambda v: llama("silu", vocab_size=v, num_key_value_heads=1),
    "qwen2": lambda v: qwen2(vocab_size=v),
    "qwen2-tied": lambda v: qwen2(vocab_size=v, tie_word_embeddings=True),
    "mistral": lambda v: mistral(vocab_size=v),
    "opt": lambda v: opt(vocab_size=v),
    "falcon-new-gqa": lambda v: falcon(vocab_size=v, new_decoder_architecture=True, num_kv_heads=2),
    "falcon-multi-query": lambda v: falcon(vocab_size=v, new_decoder_architecture=False, multi_query=True),
    "falcon-mha-sequential-bias": lambda v: falcon(vocab_size=v, new_decoder_architecture=False,
                                                   multi_query=False, parallel_attn=False, bias=True),
}


_TOKENIZERS: dict[str, tuple[Path, int]] = {}


def save_tokenizer(kind: str, out: Path) -> int:
    """Copy tokenizer ``kind`` ('spm' or 'gpt2', trained once per session) into ``out``."""
    if kind not in _TOKENIZERS:
        folder = Path(tempfile.mkdtemp(prefix=f"tok-{kind}-"))
        _TOKENIZERS[kind] = (folder, (spm_tokenizer if kind == "spm" else byte_level_tokenizer)(folder))
    folder, n = _TOKENIZERS[kind]
    shutil.copytree(folder, out, dirs_exist_ok=True)
    return n


def save_hf(name: str, out: Path, shard: str | None = None) -> torch.nn.Module:
    """Save tokenizer + random model ``name`` into ``out``; return the model (eval, eager, fp32)."""
    n_tok = save_tokenizer("spm" if name.startswith("llama") else "gpt2", out)
    model = MODELS[name](n_tok + 5)  # the embedding is a little larger than the tokenizer, as often
    model.config._attn_implementation = "eager"
    randomize(model)
    model.eval()
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return model


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------
def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@torch.no_grad()
def assert_parity(hf_model: torch.nn.Module, gguf: Path | ModelFile, prompt: list[int]) -> None:
    """Prefill + N_DECODE greedy steps (ours cached, HF on the growing sequence)."""
    ref = ReferenceModel.from_file(gguf)
    cache = ref.new_cache()
    seq = list(prompt)
    ours = ref.forward(seq, cache)  # [T, V]
    want = hf_model(input_ids=torch.tensor([seq])).logits[0].float()
    assert ours.shape == want.shape
    assert rel_err(ours, want) < REL_TOL, f"prefill: rel err {rel_err(ours, want):.2e}"
    for step in range(N_DECODE):
        tok = int(want[-1].argmax())
        gap = float(ours[-1].max() - ours[-1][tok])  # HF's greedy token is ours, or within a rounding tie
        assert gap <= TIE * float(ours[-1].abs().max()), f"greedy token differs at step {step} by {gap:.3g}"
        seq.append(tok)
        ours = ref.forward([tok], cache)
        want = hf_model(input_ids=torch.tensor([seq])).logits[0, -1:].float()
        assert rel_err(ours, want) < REL_TOL, f"decode step {step}: rel err {rel_err(ours, want):.2e}"


# what each HF option became in our config
EXPECTED_CONFIG = {
    "llama-relu": dict(arch="llama", ffn_act="reglu", n_head_kv=4, tied_output=False, rope_theta=5000.0),
    "llama-gqa-tied": dict(arch="llama", ffn_act="reglu", n_head_kv=2, tied_output=True),
    "llama-silu": dict(arch="llama", ffn_act="swiglu", n_head_kv=1),
    "qwen2": dict(arch="qwen2", ffn_act="swiglu", n_head_kv=2, qkv_bias=True, bias=False, tied_output=False,
                  rope_theta=5000.0, n_rot=D // 4),
    "qwen2-tied": dict(arch="qwen2", ffn_act="swiglu", qkv_bias=True, tied_output=True),
    "mistral": dict(arch="llama", ffn_act="swiglu", n_head_kv=2, n_ctx=CTX),
    "opt": dict(arch="opt", ffn_act="relu", bias=True, tied_output=True, n_ctx=CTX),
    "falcon-new-gqa": dict(arch="falcon", n_head_kv=2, parallel_attn=True, two_norms=True, bias=False),
    "falcon-multi-query": dict(arch="falcon", n_head_kv=1, parallel_attn=True, two_norms=False),
    "falcon-mha-sequential-bias": dict(arch="falcon", n_head_kv=4, parallel_attn=False, bias=True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_parity_with_hf(tmp_path, name):
    hf_model = save_hf(name, tmp_path / "hf")
    out = convert_hf(tmp_path / "hf", tmp_path / "m.gguf", outtype="f32", progress=False)
    mf = ModelFile(out)
    cfg, want = mf.config, EXPECTED_CONFIG[name]
    assert {k: getattr(cfg, k) for k in want} == want
    assert (cfg.n_vocab, cfg.n_embd, cfg.n_layer, cfg.n_ff, cfg.n_head) == (hf_model.config.vocab_size, D, L, F, 4)
    assert mf.magic == K.GGUF_MAGIC and not cfg.has_predictors
    # the tokenizer in the file encodes like HF's; its ids are the prompt
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    tok = Tokenizer(mf.fields)
    prompt = tok.encode(PROMPT)
    assert prompt == hf_tok.encode(PROMPT) and tok.decode(prompt) == hf_tok.decode(prompt, skip_special_tokens=True)
    assert mf.fields[K.TOK_HF_JSON] == (tmp_path / "hf" / "tokenizer.json").read_text(encoding="utf-8")
    if not name.startswith("llama"):  # the byte-level tokenizer carries a chat template
        assert mf.fields[K.CHAT_TEMPLATE] == CHAT and tok.chat_template == CHAT
    assert_parity(hf_model, mf, prompt)


def test_llama_qk_permutation_matches_llama_cpp():
    """Rows of head h: HF pairs (i, i + hd/2) become adjacent (2i, 2i + 1)."""
    n_head, hd = 2, 8
    w = torch.arange(n_head * hd, dtype=torch.float32)[:, None].repeat(1, 3)
    got = permute_qk(w, n_head)[:, 0].long().tolist()
    assert got == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def test_drelu_marker(tmp_path):
    """hidden_act "drelu" (Bamboo / TurboSparse style: relu(gate) * relu(up)) becomes ffn_act drelu."""
    save_hf("llama-relu", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_act": "drelu"}))
    mf = ModelFile(convert_hf(tmp_path / "hf", tmp_path / "m.gguf", "f32", progress=False))
    assert mf.config.ffn_act == "drelu" and mf.meta(K.FFN_ACT) == "drelu"


def test_plan_streams(tmp_path, capsys):
    """Planning reads only safetensors headers; tensors are produced one by one while writing,
    with a progress bar counting tensors."""
    save_hf("falcon-new-gqa", tmp_path / "hf")
    hf, ck = HFConfig.read(tmp_path / "hf"), Checkpoint(tmp_path / "hf")
    plan = planner_for(hf)(hf, ck, "f16", "x")
    assert ck._cached is None and all(isinstance(t, LazyTensor) for t in plan.tensors.values())
    convert_hf(tmp_path / "hf", tmp_path / "m.gguf", progress=True)
    n = len(ModelFile(tmp_path / "m.gguf").tensors)
    assert n == len(plan.tensors) and f"{n}/{n}" in capsys.readouterr().err


def test_unconverted_checkpoint_tensor_is_reported(tmp_path, caplog):
    save_hf("opt", tmp_path / "hf")
    st = tmp_path / "hf" / "model.safetensors"
    save_file({**load_file(st), "model.decoder.extra.weight": torch.zeros(2, 2)}, st, metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf", progress=False)
    assert "1 checkpoint tensors are not converted: model.decoder.extra.weight" in caplog.text


def test_rope_theta_and_falcon_layout_from_any_config_vintage(tmp_path):
    def cfg(**d) -> HFConfig:
        return HFConfig(tmp_path / "config.json", d)

    assert rope_theta(cfg(rope_parameters={"rope_type": "default", "rope_theta": 5e5})) == 5e5  # transformers 5
    assert rope_theta(cfg(rope_theta=1e6, rope_scaling=None)) == 1e6  # transformers 4
    assert rope_theta(cfg()) == 10000.0
    with pytest.raises(ConvertError, match="rope_scaling is 'linear'"):
        rope_theta(cfg(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    assert falcon_qkv_layout(cfg(new_decoder_architecture=True)) == "new"
    assert falcon_qkv_layout(cfg(model_type="RefinedWeb", n_head_kv=8)) == "new"  # original falcon-40b
    assert falcon_qkv_layout(cfg(model_type="RefinedWebModel", multi_query=True)) == "mq"  # falcon-7b
    assert falcon_qkv_layout(cfg(new_decoder_architecture=False, multi_query=False)) == "mha"


def test_sharded_checkpoint(tmp_path):
    hf_model = save_hf("llama-gqa-tied", tmp_path / "hf", shard="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    out = convert_hf(tmp_path / "hf", tmp_path / "m.gguf", outtype="f32", progress=False)
    assert_parity(hf_model, out, Tokenizer(ModelFile(out).fields).encode(PROMPT))


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_half_precision_outtype(tmp_path, outtype):
    hf_model = save_hf("falcon-new-gqa", tmp_path / "hf")
    mf = ModelFile(convert_hf(tmp_path / "hf", tmp_path / "m.gguf", outtype=outtype, progress=False))
    assert mf.config.dtype == outtype and mf.dtype_of(K.tensor(K.FFN_UP, 0)) == outtype
    assert mf.dtype_of(K.tensor(K.ATTN_NORM, 0)) == "f32"  # norms stay f32
    assert mf.meta(K.FILE_TYPE) == {"f16": 1, "bf16": 32}[outtype]
    up = hf_model.transformer.h[1].mlp.dense_h_to_4h.weight
    down = hf_model.transformer.h[1].mlp.dense_4h_to_h.weight
    torch.testing.assert_close(mf.layer(K.FFN_UP, 1, dtype=torch.float32), up.to(getattr(torch, {
        "f16": "float16", "bf16": "bfloat16"}[outtype])).float())
    assert torch.equal(mf.layer(K.FFN_DOWN_T, 1, dtype=torch.float32),
                       down.T.to(mf.layer(K.FFN_DOWN_T, 1).dtype).float())


# ------------------------------------------------------------------------------------------------
# predictors
# ------------------------------------------------------------------------------------------------
def write_predictors(folder: Path, ranks: list[int], n_embd: int = D, n_ff: int = F) -> list[dict]:
    folder.mkdir()
    g = torch.Generator().manual_seed(1)
    sds = []
    for l, r in enumerate(ranks):
        sd = {"fc1.weight": torch.randn(r, n_embd, generator=g), "fc2.weight": torch.randn(n_ff, r, generator=g)}
        torch.save(sd, folder / f"model_{l}.pt")
        sds.append(sd)
    return sds


def test_predictors_become_fc1_fc2_with_pwri(tmp_path):
    save_hf("llama-relu", tmp_path / "hf")
    sds = write_predictors(tmp_path / "pred", [16, 24])
    out = convert_hf(tmp_path / "hf", tmp_path / "m.gguf", "f32", predictors_dir=tmp_path / "pred", progress=False)
    mf = ModelFile(out)
    assert out.read_bytes()[:4] == K.PWRI_MAGIC and mf.is_sparse
    assert mf.config.predictor_ranks == (16, 24) and mf.config.sparse_threshold == 0.0
    assert mf.config.ffn_act == "reglu"
    for l, sd in enumerate(sds):
        assert torch.equal(mf.layer(K.FC1, l), sd["fc1.weight"])
        assert torch.equal(mf.layer(K.FC2, l), sd["fc2.weight"])
    # the predictor folder's config.json sets the threshold, as upstream reads it; --no-pwri
    (tmp_path / "pred" / "config.json").write_text(json.dumps({"sparse_threshold": 0.25}))
    out = convert_hf(tmp_path / "hf", tmp_path / "n.gguf", "f32", predictors_dir=tmp_path / "pred",
                     sparse=False, progress=False)
    assert out.read_bytes()[:4] == K.GGUF_MAGIC and ModelFile(out).config.sparse_threshold == 0.25


def test_predictor_files_sort_numerically(tmp_path):
    for l in range(12):
        (tmp_path / f"model_{l}.pt").touch()
    (tmp_path / "notes.txt").touch()
    assert [p.name for p in predictor_files(tmp_path, 12)] == [f"model_{l}.pt" for l in range(12)]
    with pytest.raises(ConvertError, match=r"missing layers \[12, 13\]"):
        predictor_files(tmp_path, 14)


def test_predictor_with_wrong_shape(tmp_path):
    save_hf("llama-relu", tmp_path / "hf")
    write_predictors(tmp_path / "pred", [16, 16], n_ff=F + 1)
    with pytest.raises(ConvertError) as exc:
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf", "f32", predictors_dir=tmp_path / "pred", progress=False)
    assert "model_0.pt" in str(exc.value) and f"n_ff={F}" in str(exc.value)
    assert not (tmp_path / "m.gguf").exists()


def test_missing_predictor_layer(tmp_path):
    save_hf("opt", tmp_path / "hf")
    write_predictors(tmp_path / "pred", [8])
    with pytest.raises(ConvertError, match=r"model_1\.pt.*missing layers \[1\]"):
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf", "f32", predictors_dir=tmp_path / "pred", progress=False)


# ------------------------------------------------------------------------------------------------
# clear errors
# ------------------------------------------------------------------------------------------------
def test_missing_config_json(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(ConvertError, match=r"config\.json: no such file"):
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf")


@pytest.mark.parametrize("name,field,value,says", [
    ("llama-relu", "hidden_act", "gelu", "hidden_act is 'gelu'"),
    ("opt", "activation_function", "gelu", "activation_function is 'gelu'"),
    ("falcon-multi-query", "activation", "gelu", "activation is 'gelu'"),
    ("falcon-multi-query", "alibi", True, "alibi is True"),
    ("opt", "do_layer_norm_before", False, "do_layer_norm_before is False"),
    ("opt", "word_embed_proj_dim", 32, "word_embed_proj_dim is 32"),
    ("llama-relu", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
     "rope_parameters['rope_type'] is 'linear'"),
    ("llama-relu", "architectures", ["GPT2LMHeadModel"], "architectures is ['GPT2LMHeadModel']"),
])
def test_unsupported_config_is_a_clear_error(tmp_path, name, field, value, says):
    save_hf(name, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    cfg[field] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConvertError) as exc:
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf", progress=False)
    assert str(exc.value).startswith(f"{path}: {says}"), str(exc.value)


def test_missing_tensor_is_a_clear_error(tmp_path):
    save_hf("llama-relu", tmp_path / "hf")
    st = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(st)
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=r"missing tensor 'model\.layers\.1\.mlp\.gate_proj\.weight'"):
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.gguf.part").exists()


def test_no_safetensors_is_a_clear_error(tmp_path):
    save_hf("opt", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(ConvertError, match="no model.safetensors"):
        convert_hf(tmp_path / "hf", tmp_path / "m.gguf", progress=False)


@pytest.mark.parametrize("fields, n_ctx", [
    ({"model_type": "mistral", "sliding_window": 64}, 64),  # Mistral-7B-v0.1: attention within 4096
    ({"model_type": "mistral", "sliding_window": None}, CTX),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64}, CTX),  # set but unused
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, 64),
    ({"model_type": "llama"}, CTX),
])
def test_sliding_window_caps_the_context(tmp_path, fields, n_ctx):
    """Within the window sliding-window attention is full attention: the context stops there."""
    hf = HFConfig(tmp_path / "config.json", {"max_position_embeddings": CTX, **fields})
    assert _context_length(hf) == n_ctx
