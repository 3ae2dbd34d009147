"""Tokenizer parity with HF: real BPE tokenizers trained offline (GPT-2 byte-level and Llama-style
SentencePiece BPE with byte fallback), saved with transformers, turned into GGUF metadata, and
rebuilt both from the stored tokenizer.json and from the llama.cpp-style fields alone."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import pydoc_data.topics
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from powerinfer_ray.model import gguf_keys as K  # noqa: E402
from powerinfer_ray.model.gguf_file import ModelFile  # noqa: E402
from powerinfer_ray.model.gguf_writer import write_model  # noqa: E402
from powerinfer_ray.model.tiny import tiny_config, tiny_weights  # noqa: E402
from powerinfer_ray.model.tokenizer import (  # noqa: E402
    SPM, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED, IncrementalText, Tokenizer,
    hf_tokenizer_fields)

CORPUS = list(pydoc_data.topics.topics.values())
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def sample_texts() -> list[str]:
    """Strings that stress pre-tokenization: unicode, runs of spaces, newlines, digits, specials."""
    fixed = [
        "", " ", "  ", "\n", "Hello world", " Hello world", "Hello  world ", "  two leading",
        "trailing  ", "a\nb\n\nc\r\n", "\ttab\tseparated\t", "1234567890 3.14159 -42 1e-9 0x1F",
        "naïve café résumé", "日本語のテキスト", "Ünïcödé ✓ 🙂🚀 emoji", "mixed: αβγ δ, ε!",
        "def f(x):\n    return x ** 2  # comment\n", "x</s>y", "<s> start", "don't can't it's",
        "\u00a0non-breaking\u2009thin\u200bzero-width", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
    ]
    rng = random.Random(0)
    lines = [ln for doc in CORPUS[:20] for ln in doc.splitlines() if ln.strip()]
    pool = "abc XYZ 019 \n\t.,;:!?éüñ日本語🙂αβγ" + SPM
    random_strings = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(60)]
    return fixed + rng.sample(lines, 60) + [CORPUS[3][:2000]] + random_strings


# ------------------------------------------------------------------------------------------------
# tokenizers trained here, saved through transformers
# ------------------------------------------------------------------------------------------------
def train_byte_level(tmp: Path) -> Path:
    """GPT-2 style byte-level BPE (no BOS added by the post-processor)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    hf.chat_template = CHAT
    out = tmp / "gpt2"
    hf.save_pretrained(out)
    return out


def train_spm_style(tmp: Path, legacy: bool) -> Path:
    """Llama-style vocabulary: <unk> <s> </s>, 256 byte-fallback tokens <0xNN>, then BPE pieces
    with "▁" for spaces. ``legacy`` uses Llama-2's tokenizer.json pipeline (Prepend + Replace
    normalizer), else transformers 5's LlamaTokenizer one (Metaspace, prepend_scheme 'first')."""
    base = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM, prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=120, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    spec = json.loads(base.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in spec["model"]["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPM), normalizers.Replace(" ", SPM)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPM, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out = tmp / ("spm-legacy" if legacy else "spm")
    hf.save_pretrained(out)
    return out


def fields_of(tok_dir: Path, n_vocab: int | None = None) -> dict:
    """What the converter stores: tokenizer.json verbatim + llama.cpp-style fields."""
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    template = tok_dir / "chat_template.jinja"
    return hf_tokenizer_fields((tok_dir / "tokenizer.json").read_text(encoding="utf-8"), config,
                               template.read_text() if template.exists() else None, n_vocab)


def without_hf_json(fields: dict, *drop: str) -> dict:
    return {k: v for k, v in fields.items() if k not in (K.TOK_HF_JSON, *drop)}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tokenizers")
    return {"gpt2": train_byte_level(tmp), "spm": train_spm_style(tmp, legacy=False),
            "spm-legacy": train_spm_style(tmp, legacy=True)}


def assert_same_as_hf(ours: Tokenizer, hf, texts: list[str]) -> None:
    for text in texts:
        want = hf.encode(text)
        assert ours.encode(text) == want, (text, ours.encode(text), want)
        assert ours.decode(want) == hf.decode(want, skip_special_tokens=True), text
        assert ours.decode(want, skip_special=False) == hf.decode(want, skip_special_tokens=False), text


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "spm", "spm-legacy"])
@pytest.mark.parametrize("source", ["hf-json", "llama.cpp-fields"])
def test_encode_decode_like_hf(tok_dirs, kind, source):
    hf = AutoTokenizer.from_pretrained(tok_dirs[kind])
    fields = fields_of(tok_dirs[kind])
    if source == "llama.cpp-fields":
        fields = without_hf_json(fields)
    assert_same_as_hf(Tokenizer(fields), hf, sample_texts())


@pytest.mark.parametrize("kind", ["gpt2", "spm", "spm-legacy"])
def test_incremental_text_equals_the_full_decode_at_every_token(tok_dirs, kind, monkeypatch):
    """A generation's text decoded a few ids a step equals the decode of all its ids after every id
    (less a trailing incomplete UTF-8 sequence, which the final update keeps): texts whose characters
    span several byte tokens, and random ids (byte tokens in the middle of words, specials, sequences
    that never complete)."""
    tok = Tokenizer(fields_of(tok_dirs[kind]))
    n = len(tok.tok.get_vocab())
    rng = random.Random(1)
    seqs = [tok.encode(t) for t in sample_texts() if t] + [[rng.randrange(n) for _ in range(60)] for _ in range(40)]
    for ids in seqs:
        inc = IncrementalText(tok)
        for i in range(1, len(ids) + 1):
            assert inc.update(ids[:i]) == tok.decode(ids[:i]).rstrip("\ufffd"), (kind, ids[:i])
        assert inc.update(ids, final=True) == tok.decode(ids), (kind, ids)
    assert any(tok.decode(ids).endswith("\ufffd") for ids in seqs)  # the final update's case occurs
    # and a step decodes a few ids, not the output so far: a long text's (1000+ ids) widest window
    ids = tok.encode(" ".join(CORPUS[3:6])[:6000])
    widths: list[int] = []
    seen = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, x, skip_special=True: widths.append(len(x))
                        or seen(self, x, skip_special))
    inc = IncrementalText(tok)
    for i in range(1, len(ids) + 1):
        inc.update(ids[:i])
    assert len(ids) > 1000 and max(widths[20:]) <= 12, (len(ids), max(widths[20:]))


@pytest.mark.parametrize("kind", ["spm", "spm-legacy"])
def test_spm_rebuild_from_scores_alone(tok_dirs, kind):
    """A 'llama' vocab without merges (as upstream files have it) merges by score; the scores we
    write make that follow the HF merge order on real text."""
    hf = AutoTokenizer.from_pretrained(tok_dirs[kind])
    fields = without_hf_json(fields_of(tok_dirs[kind]), K.TOK_MERGES)
    assert_same_as_hf(Tokenizer(fields), hf, sample_texts())


def test_metadata_values(tok_dirs):
    g = fields_of(tok_dirs["gpt2"])
    vocab = json.loads((tok_dirs["gpt2"] / "tokenizer.json").read_text())["model"]["vocab"]
    assert g[K.TOK_MODEL] == "gpt2" and g[K.TOK_PRE] == "default"
    assert g[K.TOK_TOKENS][:3] == sorted(vocab, key=vocab.get)[:3] and len(g[K.TOK_TOKENS]) == len(vocab)
    assert g[K.TOK_BOS] == g[K.TOK_EOS] == vocab["<|endoftext|>"] == 0
    assert g[K.TOK_TYPES][0] == TOKEN_CONTROL and set(g[K.TOK_TYPES][1:]) == {TOKEN_NORMAL}
    assert g[K.TOK_ADD_BOS] is False and g[K.TOK_ADD_EOS] is False
    assert g[K.CHAT_TEMPLATE] == CHAT
    assert g[K.TOK_MERGES][0] == "Ġ Ġ" or " " in g[K.TOK_MERGES][0]

    s = fields_of(tok_dirs["spm"])
    assert s[K.TOK_MODEL] == "llama" and s[K.TOK_SPM_PREPEND] == "first" and s[K.TOK_ADD_SPACE_PREFIX]
    assert (s[K.TOK_BOS], s[K.TOK_EOS], s[K.TOK_UNK]) == (1, 2, 0) and s[K.TOK_ADD_BOS] is True
    assert s[K.TOK_TYPES][:4] == [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_BYTE]
    assert s[K.TOK_TOKENS][3 + 0x41] == "<0x41>" and s[K.TOK_TYPES][258] == TOKEN_BYTE
    # score of a piece = -(rank of the merge making it): the first merge scores highest
    a, b = s[K.TOK_MERGES][0].split(" ")
    assert s[K.TOK_SCORES][s[K.TOK_TOKENS].index(a + b)] == 0.0
    a, b = s[K.TOK_MERGES][10].split(" ")
    assert s[K.TOK_SCORES][s[K.TOK_TOKENS].index(a + b)] == -10.0
    assert fields_of(tok_dirs["spm-legacy"])[K.TOK_SPM_PREPEND] == "legacy"


def test_padded_vocabulary(tok_dirs):
    """A model vocabulary larger than the tokenizer's is padded with unused [PADi] tokens."""
    hf = AutoTokenizer.from_pretrained(tok_dirs["spm"])
    n = len(hf) + 7
    fields = fields_of(tok_dirs["spm"], n_vocab=n)
    assert len(fields[K.TOK_TOKENS]) == n and fields[K.TOK_TOKENS][-1] == f"[PAD{n - 1}]"
    assert fields[K.TOK_TYPES][-7:] == [TOKEN_UNUSED] * 7
    assert_same_as_hf(Tokenizer(without_hf_json(fields)), hf, sample_texts()[:40])


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_gguf_round_trip(tmp_path, tok_dirs, kind):
    """Through a GGUF file: the HF json comes back byte for byte, and both rebuilds match HF."""
    fields = fields_of(tok_dirs[kind])
    cfg = tiny_config("llama-reglu", n_vocab=len(fields[K.TOK_TOKENS]))
    mf = ModelFile(write_model(tmp_path / "m.gguf", cfg, tiny_weights(cfg), metadata=fields))
    assert mf.fields[K.TOK_HF_JSON] == (tok_dirs[kind] / "tokenizer.json").read_text(encoding="utf-8")
    assert mf.fields[K.TOK_TOKENS] == fields[K.TOK_TOKENS]
    hf = AutoTokenizer.from_pretrained(tok_dirs[kind])
    texts = sample_texts()[:50]
    assert_same_as_hf(Tokenizer(mf.fields), hf, texts)
    assert_same_as_hf(Tokenizer(without_hf_json(mf.fields)), hf, texts)


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer({})
