"""The quality report: dense perplexity equal to HF transformers' on the same token stream,
the oracle mask equal to dense, the predictor-sparse forward against both, and the margin."""
from __future__ import annotations

import pytest
import torch

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.model.tokenizer import Tokenizer
from powerinfer_ray.offline.corpus import frozen_documents
from powerinfer_ray.offline.quality import OracleHooks, RecordHooks, format_report, quality_report
from powerinfer_ray.offline.stream import StreamFormat
from powerinfer_ray.offline.train_tiny import trained_model_path

TEXT = " ".join(frozen_documents("heldout")[:4])
DOCS = frozen_documents("heldout", shuffle_seed=1)[:40]


@pytest.mark.parametrize("variant", ["llama-reglu", "llama-drelu", "llama-relu", "opt", "falcon"])
def test_oracle_mask_equals_dense(tmp_path, variant):
    path = write_tiny_model(tmp_path / "m.gguf", variant, n_ctx=64)
    ref = ReferenceModel.from_file(path)
    tokens = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    rec = RecordHooks()
    dense = ref.forward(tokens, ref.new_cache(), rec)
    assert sorted(rec.masks) == list(range(ref.cfg.n_layer))
    assert 0.05 < float(rec.masks[0].float().mean()) < 0.95  # the oracle really drops neurons
    oracle = ref.forward(tokens, ref.new_cache(), OracleHooks(rec.masks))
    torch.testing.assert_close(oracle, dense, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# dense perplexity: the same number as HF transformers on the same stream
# ------------------------------------------------------------------------------------------------
def hf_llama(ref: ReferenceModel):  # noqa: ANN201
    """The embedded model (llama, ReGLU = HF's hidden_act relu, tied head) as an HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = ref.cfg
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv, hidden_act="relu",
        max_position_embeddings=c.n_ctx, rms_norm_eps=c.norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}))

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:  # GGML pairs (2i, 2i+1) -> HF (i, i + hd/2)
        return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    sd = {"model.embed_tokens.weight": ref.w[K.global_tensor(K.TOKEN_EMBD)],
          "model.norm.weight": ref.w[K.global_tensor(K.OUTPUT_NORM)]}
    for l in range(c.n_layer):
        t = lambda tmpl: ref.w[K.tensor(tmpl, l)]  # noqa: E731
        p = f"model.layers.{l}."
        sd.update({p + "input_layernorm.weight": t(K.ATTN_NORM), p + "post_attention_layernorm.weight": t(K.FFN_NORM),
                   p + "self_attn.q_proj.weight": unpermute(t(K.ATTN_Q), c.n_head),
                   p + "self_attn.k_proj.weight": unpermute(t(K.ATTN_K), c.n_head_kv),
                   p + "self_attn.v_proj.weight": t(K.ATTN_V), p + "self_attn.o_proj.weight": t(K.ATTN_OUT),
                   p + "mlp.gate_proj.weight": t(K.FFN_GATE), p + "mlp.up_proj.weight": t(K.FFN_UP),
                   p + "mlp.down_proj.weight": t(K.FFN_DOWN_T).T})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.config._attn_implementation = "eager"
    return model.eval()


def hand_windows(stream: list[int], T: int, bos: int | None) -> list[list[int]]:
    """The stream cut into windows of T: with ``bos``, BOS + T - 1 stream tokens (a stream BOS
    at a cut is that BOS)."""
    out, i = [], 0
    body = T - (bos is not None)
    while True:
        if bos is not None and i < len(stream) and stream[i] == bos:
            i += 1
        if len(stream) - i < body:
            return out
        out.append(([bos] if bos is not None else []) + stream[i:i + body])
        i += body


@pytest.mark.parametrize("window_bos", [False, True])
def test_dense_perplexity_equals_transformers_on_the_stream(window_bos):
    pytest.importorskip("transformers")
    path = trained_model_path()
    ref = ReferenceModel.from_file(path)
    tok = Tokenizer(ModelFile(path).fields)
    stream: list[int] = []
    for i, d in enumerate(DOCS):  # documents joined by BOS, as the model was trained
        stream += ([tok.bos_id] if i else []) + tok.encode(d, add_bos=False)
    windows = hand_windows(stream, 128, tok.bos_id if window_bos else None)[:12]
    hf = hf_llama(ref)
    with torch.no_grad():
        nll = sum(float(hf(input_ids=torch.tensor([w]), labels=torch.tensor([w])).loss) * (len(w) - 1) for w in windows)
    hf_ppl = float(torch.exp(torch.tensor(nll / sum(len(w) - 1 for w in windows), dtype=torch.float64)))
    r = quality_report(path, DOCS, seq_len=128, max_tokens=128 * 12, fmt=StreamFormat("bos", window_bos))
    assert r["tokens"] == 12 * 127
    assert r["ppl_dense"] == pytest.approx(hf_ppl, rel=1e-3)  # the bar is 0.1 %; fp32 gives ~1e-6
    assert r["ppl_dense"] < 40  # a trained model on its own kind of text (uniform would be 1024)


# ------------------------------------------------------------------------------------------------
# the report on sparse models
# ------------------------------------------------------------------------------------------------
def test_quality_report_on_a_seeded_sparse_model(tmp_path):
    path = write_tiny_model(tmp_path / "s.gguf", "llama-reglu", n_ctx=64, predictor_rank=16)
    r = quality_report(path, TEXT, seq_len=64, max_tokens=256)
    assert r["tokens"] == 4 * 63 and r["threshold"] == 0.0
    assert r["ppl_oracle"] == pytest.approx(r["ppl_dense"], rel=1e-5)
    assert r["oracle_top1_agreement"] == 1.0 and r["oracle_max_abs_logit_diff"] < 1e-4
    assert 0.0 <= r["top1_agreement"] <= 1.0
    assert len(r["layers"]) == 2 and all(0 <= s["recall"] <= 1 for s in r["layers"])
    assert "top-1 agreement" in format_report(r)


def test_quality_report_of_a_dense_model(tmp_path):
    path = write_tiny_model(tmp_path / "d.gguf", "llama-reglu", n_ctx=64)
    r = quality_report(path, TEXT, seq_len=64, max_tokens=128)
    assert "ppl_sparse" not in r and r["ppl_dense"] > 1
    assert "no predictors" in format_report(r)


def test_the_margin_moves_sparsity_and_quality_monotonically():
    """A larger margin keeps more neurons: sparsity falls, the sparse model's divergence from
    dense shrinks and top-1 agreement grows (the embedded model's own predictors, held-out
    text). Perplexity itself is too noisy a measure at 0.1 % differences; KL is not."""
    margins = (-0.5, 0.0, 1.0, 4.0)
    rs = [quality_report(trained_model_path(), "builtin:heldout", seq_len=128, max_tokens=1024, margin=m,
                         oracle=False) for m in margins]
    sparsity, kl, top1 = ([r[k] for r in rs] for k in ("sparsity", "kl", "top1_agreement"))
    assert sparsity == sorted(sparsity, reverse=True) and sparsity[0] > sparsity[-1] + 0.02, sparsity
    assert kl == sorted(kl, reverse=True) and kl[-1] < kl[0] / 4, kl
    assert top1 == sorted(top1) and top1[-1] > top1[0], top1
    assert [r["margin"] for r in rs] == list(margins) and "ppl_oracle" not in rs[0]
    assert [r["margin"] for r in rs] == [-0.5, 0.0, 1.0, 4.0]
