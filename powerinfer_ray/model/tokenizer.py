"""Tokenizers rebuilt from GGUF metadata with the ``tokenizers`` package.

Sources, in order of preference: the exact HF ``tokenizer.json`` stored under
``tokenizer.huggingface.json``; a GPT-2 style byte-level BPE vocabulary
(``tokenizer.ggml.model == "gpt2"``: tokens + merges); a llama SentencePiece-style vocabulary
(``"llama"``: tokens + scores + token types, byte-fallback tokens ``<0xNN>``).
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from . import gguf_keys as K

BOS, EOS = "<s>", "</s>"
BYTE_VOCAB_SIZE = 258  # 256 byte tokens + <s> + </s>
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_level_fields(extra_tokens: list[str] | None = None, merges: list[str] | None = None) -> dict[str, Any]:
    """GGUF tokenizer metadata of a GPT-2 style byte-level vocabulary: byte tokens 0..255 (in
    byte order), then ``extra_tokens`` (merged pieces, in merge order), then <s>, </s>."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + list(extra_tokens or []) + [BOS, EOS]
    types = [TOKEN_NORMAL] * (len(tokens) - 2) + [TOKEN_CONTROL, TOKEN_CONTROL]
    return {
        K.TOK_MODEL: "gpt2",
        K.TOK_TOKENS: tokens,
        K.TOK_TYPES: types,
        K.TOK_MERGES: list(merges or []),
        K.TOK_BOS: len(tokens) - 2,
        K.TOK_EOS: len(tokens) - 1,
        K.TOK_ADD_BOS: True,
    }


class Tokenizer:
    """Text <-> token ids for a model, built from its GGUF metadata."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields
        self.tok = build_hf_tokenizer(fields)
        self.bos_id = _opt_int(fields.get(K.TOK_BOS))
        self.eos_id = _opt_int(fields.get(K.TOK_EOS))
        self.add_bos = bool(fields.get(K.TOK_ADD_BOS, self.bos_id is not None))
        self.chat_template = fields.get(K.CHAT_TEMPLATE)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def build_hf_tokenizer(fields: Mapping[str, Any]) -> HFTokenizer:
    """A ``tokenizers.Tokenizer`` from GGUF metadata; raises ValueError naming what is missing."""
    if fields.get(K.TOK_HF_JSON):
        return HFTokenizer.from_str(fields[K.TOK_HF_JSON])
    kind = fields.get(K.TOK_MODEL)
    tokens = fields.get(K.TOK_TOKENS)
    if kind is None or tokens is None:
        raise ValueError(f"model has no tokenizer: metadata {K.TOK_MODEL!r} / {K.TOK_TOKENS!r} missing; "
                         "pass prompt token ids instead of text")
    if kind == "gpt2":
        return _gpt2_tokenizer(list(tokens), list(fields.get(K.TOK_MERGES) or []),
                               list(fields.get(K.TOK_TYPES) or []))
    if kind == "llama":
        return _spm_tokenizer(list(tokens), list(fields.get(K.TOK_SCORES) or []),
                              list(fields.get(K.TOK_TYPES) or []), _opt_int(fields.get(K.TOK_UNK)))
    raise ValueError(f"tokenizer model {kind!r} is not supported: expected 'gpt2' or 'llama'")


def _special_ids(tokens: list[str], types: list[int]) -> list[str]:
    return [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]


def _gpt2_tokenizer(tokens: list[str], merges: list[str], types: list[int]) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_special_ids(tokens, types))
    return tok


def _spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], unk: int | None) -> HFTokenizer:
    """SentencePiece-BPE as llama.cpp's 'llama' vocab: merges ordered by the merged piece's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = scores if scores else [0.0] * len(tokens)
    merges = []
    for piece, pid in vocab.items():
        if len(piece) < 2 or (types and types[pid] != TOKEN_NORMAL):
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((score[pid], vocab[a], vocab[b], a, b))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk_token = tokens[unk] if unk is not None else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk_token,
                                 fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(_special_ids(tokens, types))
    return tok


def hf_json_field(tokenizer_json: str | dict) -> dict[str, str]:
    """Metadata that stores an HF tokenizer.json verbatim (exact round trip)."""
    text = tokenizer_json if isinstance(tokenizer_json, str) else json.dumps(tokenizer_json)
    return {K.TOK_HF_JSON: text}
