"""``powerinfer-ray generate`` on a model converted from HF transformers: the token ids it prints
(``--json``, ``--print-token-ids``) are HF's own greedy ids (up to rounding ties) for the dense and the oracle policy,
and on a host without a GPU its timings say that the primary ran on the CPU."""
from __future__ import annotations

import json

import pydoc_data.topics
import pytest
import torch
from ties import FullForward, assert_counts, assert_greedy  # noqa: E402

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from powerinfer_ray import cli  # noqa: E402
from powerinfer_ray.offline.convert import convert_hf  # noqa: E402

PROMPT = "The quick brown fox"
N = 10


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random ReLU-Llama (ReGLU) with a trained byte-level BPE, saved as HF and converted to GGUF."""
    out = tmp_path_factory.mktemp("hf")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:30], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>").save_pretrained(out)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      hidden_act="relu", max_position_embeddings=128, vocab_size=330, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * r if p.dim() == 1 else (r if "embed" in name else r / p.shape[1] ** 0.5))
    model.config._attn_implementation = "eager"
    model.eval().save_pretrained(out)
    gguf = convert_hf(out, out / "m.gguf", outtype="f32", progress=False)
    return model, AutoTokenizer.from_pretrained(out), str(gguf)


def _hf(model) -> FullForward:  # noqa: ANN001
    """The HF model as assert_greedy's reference (its greedy would stop at </s>; ours does too)."""
    return FullForward(lambda ids: model(input_ids=torch.tensor([ids])).logits[0])


@pytest.mark.parametrize("policy", ["dense", "oracle"])
def test_generate_json_ids_equal_hf_greedy(ray_cluster, hf, capsys, policy):
    model, tok, gguf = hf
    assert cli.main(["generate", "-m", gguf, "-p", PROMPT, "-n", str(N), "--json", "--policy", policy,
                     "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    want_prompt = tok(PROMPT).input_ids
    assert out["prompt_token_ids"] == want_prompt and out["policy"] == policy
    assert_greedy(_hf(model), want_prompt, out["token_ids"])
    assert len(out["token_ids"]) == N  # no early end of sequence: every step compared
    assert out["text"] == tok.decode(out["token_ids"]) and out["stats"]["completion_tokens"] == len(out["token_ids"])


def test_generate_prints_token_ids_and_where_the_primary_ran(ray_cluster, hf, capsys):
    model, tok, gguf = hf
    assert cli.main(["generate", "-m", gguf, "-p", PROMPT, "-n", str(N), "--print-token-ids", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    ids = json.loads(out.strip().splitlines()[-1].removeprefix("token ids: "))
    assert len(ids) == N
    assert_greedy(_hf(model), tok(PROMPT).input_ids, ids)
    assert "no GPU: the primary ran on the CPU" in err and "GPU share" not in err


def test_generate_saves_the_engines_activation_counts(ray_cluster, hf, capsys, tmp_path):
    """``--save-activation DIR`` (policy oracle, neurons on both executors): the counts read back
    from DIR are the reference's nonzero activations over the tokens the engine ran (the prompt
    and every generated token but the last, which no step takes in)."""
    from powerinfer_ray.model.reference import ReferenceModel
    from powerinfer_ray.offline.profile import ActivationStats

    model, tok, gguf = hf
    assert cli.main(["generate", "-m", gguf, "-p", PROMPT, "-n", str(N), "--json", "--policy", "oracle",
                     "--gpu-fraction", "0.5", "--device", "cpu", "--save-activation", str(tmp_path / "act")]) == 0
    out, err = capsys.readouterr()
    ran = json.loads(out)["prompt_token_ids"] + json.loads(out)["token_ids"][:-1]
    got = ActivationStats.load_parquet(tmp_path / "act" / "activation.parquet")
    ref = ReferenceModel.from_file(gguf)
    assert got.n_tokens == len(ran) and f"activation counts of {len(ran)} tokens" in err
    assert_counts(ref, [ran], got.counts)
    assert 0 < got.counts.sum() < got.counts.size * len(ran)
