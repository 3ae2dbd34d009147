"""Tokenizers rebuilt from GGUF metadata with the ``tokenizers`` package, and the inverse: GGUF
tokenizer metadata from an HF ``tokenizer.json``.

Sources, in order of preference: the exact HF ``tokenizer.json`` stored under
``tokenizer.huggingface.json``; a GPT-2 style byte-level BPE vocabulary
(``tokenizer.ggml.model == "gpt2"``: tokens + merges); a llama SentencePiece-style vocabulary
(``"llama"``: tokens + scores + token types, byte-fallback tokens ``<0xNN>``; merges when the file
has them, else merges ranked by the merged piece's score as SentencePiece-BPE and llama.cpp do).

``hf_tokenizer_fields`` writes both: the HF json verbatim (exact round trip) and the llama.cpp-style
fields, chosen so that the rebuild from those fields alone encodes and decodes like the HF
tokenizer too (and upstream tools can read the file).
"""
from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from typing import Any, Iterator, Mapping

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from . import gguf_keys as K

log = logging.getLogger(__name__)

BOS, EOS = "<s>", "</s>"
BYTE_VOCAB_SIZE = 258  # 256 byte tokens + <s> + </s>
# llama.cpp's token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPM = "\u2581"  # SentencePiece's visible space
SPM_PREPEND_SCHEMES = ("legacy", "first", "always", "never")
# score of a multi-character piece no merge produces: merged last (llama.cpp merges by score)
NO_MERGE_SCORE = -1e9
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


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
    """Text <-> token ids for a model, built from its GGUF metadata.

    ``encode`` equals HF's ``tokenizer.encode(text)`` (special tokens added as the HF
    post-processor adds them: BOS when ``add_bos``, EOS when ``add_eos``); ``decode`` equals HF's
    ``tokenizer.decode(ids, skip_special_tokens=skip_special)``.
    """

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields
        self.tok = build_hf_tokenizer(fields)
        self.bos_id = _opt_int(fields.get(K.TOK_BOS))
        self.eos_id = _opt_int(fields.get(K.TOK_EOS))
        self.add_bos = bool(fields.get(K.TOK_ADD_BOS, self.bos_id is not None))
        self.add_eos = bool(fields.get(K.TOK_ADD_EOS, False))
        self.chat_template = fields.get(K.CHAT_TEMPLATE)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)


class IncrementalText:
    """The text of a growing list of token ids (a generation's output), decoding only its last few
    ids at each step, as HF's TextStreamer and vLLM do: ``update(ids)`` returns what
    ``tok.decode(ids)`` would, less a trailing incomplete UTF-8 sequence (U+FFFD, which waits for
    its next bytes; with ``final``, the output's end, it stays), where decoding the whole output at
    every step would cost time in proportion to its length. The ids since the last complete text
    are decoded after the ids that gave the text before them (never after special tokens alone,
    which decode to nothing), so a piece's leading space decodes as it does in context: a
    SentencePiece decoder strips it from the first piece of a decode only. A window whose start
    decodes otherwise in context is decoded in full again."""

    def __init__(self, tok: "Tokenizer") -> None:
        self.tok = tok
        self.done = ""  # the text of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read]: the window's context (text, unless at the start)

    def update(self, ids: list[int], final: bool = False) -> str:
        before = self.tok.decode(ids[self.prefix:self.read])
        now = self.tok.decode(ids[self.prefix:])
        if not now.startswith(before):
            self.done, self.prefix, self.read = "", 0, 0
            before, now = "", self.tok.decode(ids)
        if now.endswith("\ufffd") and not final:
            return self.done + now[len(before):].rstrip("\ufffd")
        added = now[len(before):]
        self.done += added
        if added:  # ids[read:] gave text: the next window's context
            self.prefix = self.read
        self.read = len(ids)
        return self.done


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


# ------------------------------------------------------------------------------------------------
# GGUF metadata -> tokenizer
# ------------------------------------------------------------------------------------------------
def build_hf_tokenizer(fields: Mapping[str, Any], prefer_hf_json: bool = True) -> HFTokenizer:
    """A ``tokenizers.Tokenizer`` from GGUF metadata; raises ValueError naming what is missing.

    ``prefer_hf_json=False`` ignores a stored HF json and rebuilds from the llama.cpp-style fields.
    """
    if prefer_hf_json and fields.get(K.TOK_HF_JSON):
        return HFTokenizer.from_str(fields[K.TOK_HF_JSON])
    kind = fields.get(K.TOK_MODEL)
    tokens = fields.get(K.TOK_TOKENS)
    if kind is None or tokens is None:
        raise ValueError(f"model has no tokenizer: metadata {K.TOK_MODEL!r} / {K.TOK_TOKENS!r} missing; "
                         "pass prompt token ids instead of text")
    tokens, types = list(tokens), list(fields.get(K.TOK_TYPES) or [])
    if kind == "gpt2":
        return _gpt2_tokenizer(tokens, list(fields.get(K.TOK_MERGES) or []), types,
                               bool(fields.get(K.TOK_ADD_SPACE_PREFIX, False)))
    if kind == "llama":
        return _spm_tokenizer(tokens, list(fields.get(K.TOK_SCORES) or []), types,
                              _opt_int(fields.get(K.TOK_UNK)), list(fields.get(K.TOK_MERGES) or []),
                              _spm_prepend_scheme(fields), bool(fields.get(K.TOK_SPM_SPLIT, False)))
    raise ValueError(f"tokenizer model {kind!r} is not supported: expected 'gpt2' or 'llama'")


def _spm_prepend_scheme(fields: Mapping[str, Any]) -> str:
    """Our key when present; else llama.cpp's add_space_prefix (default on, SentencePiece-style)."""
    scheme = fields.get(K.TOK_SPM_PREPEND)
    if scheme is None:
        return "legacy" if fields.get(K.TOK_ADD_SPACE_PREFIX, True) else "never"
    if scheme not in SPM_PREPEND_SCHEMES:
        raise ValueError(f"metadata {K.TOK_SPM_PREPEND!r} is {scheme!r}, expected one of {SPM_PREPEND_SCHEMES}")
    return str(scheme)


def _add_vocab_specials(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (matched whole in text, skipped by
    ``decode(skip_special_tokens=True)``), user-defined ones plain added tokens, as HF has them."""
    special = [t for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [t for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok.add_special_tokens(special)


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]


def _gpt2_tokenizer(tokens: list[str], merges: list[str], types: list[int],
                    add_prefix_space: bool = False) -> HFTokenizer:
    """GPT-2 byte-level BPE: GPT-2's split regex, then bytes as printable characters."""
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(merges), fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    _add_vocab_specials(tok, tokens, types)
    return tok


def _spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], unk: int | None,
                   merges: list[str] | None = None, scheme: str = "legacy", split: bool = False) -> HFTokenizer:
    """SentencePiece-BPE as llama.cpp's 'llama' vocab, with byte fallback.

    Merges are the file's when it has them; otherwise every split of a normal piece into two
    vocabulary pieces, ranked by the merged piece's score (highest first), which is how
    SentencePiece-BPE and llama.cpp merge. ``scheme`` says how "▁" is prepended: 'legacy'
    (a SentencePiece normalizer: every text segment, even one starting with a space), or
    HF's Metaspace ``prepend_scheme`` 'first' / 'always' / 'never'.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _merge_pairs(merges) if merges else _merges_from_scores(vocab, scores, types)
    unk_token = tokens[unk] if unk is not None else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    if scheme == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPM), normalizers.Replace(" ", SPM)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM, prepend_scheme=scheme, split=split)
    steps = [decoders.Replace(SPM, " "), decoders.ByteFallback(), decoders.Fuse()]
    if scheme != "never":
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    _add_vocab_specials(tok, tokens, types)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    score = scores if scores else [0.0] * len(vocab)
    merges = []
    for piece, pid in vocab.items():
        if len(piece) < 2 or (types and types[pid] != TOKEN_NORMAL):
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((score[pid], vocab[a], vocab[b], a, b))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(a, b) for *_, a, b in merges]


# ------------------------------------------------------------------------------------------------
# HF tokenizer.json -> GGUF metadata
# ------------------------------------------------------------------------------------------------
def hf_json_field(tokenizer_json: str | dict) -> dict[str, str]:
    """Metadata that stores an HF tokenizer.json verbatim (exact round trip)."""
    text = tokenizer_json if isinstance(tokenizer_json, str) else json.dumps(tokenizer_json)
    return {K.TOK_HF_JSON: text}


def hf_tokenizer_fields(tokenizer_json: str, tokenizer_config: Mapping[str, Any] | None = None,
                        chat_template: str | None = None, n_vocab: int | None = None,
                        fallback_ids: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """GGUF tokenizer metadata of an HF tokenizer: ``tokenizer.json`` verbatim plus llama.cpp-style
    fields (vocabulary, special ids, chat template).

    ``tokenizer_config`` is HF's tokenizer_config.json (bos/eos/unk/pad tokens, chat_template);
    ``n_vocab`` the model's vocabulary size (the token list is padded to it with ``[PADi]``
    tokens, as llama.cpp's converter does); ``fallback_ids`` config.json's ``bos_token_id`` /
    ``eos_token_id`` / ``pad_token_id`` for tokens the tokenizer config does not name.
    """
    spec = json.loads(tokenizer_json)
    tok = HFTokenizer.from_str(tokenizer_json)
    config = dict(tokenizer_config or {})
    fields: dict[str, Any] = hf_json_field(tokenizer_json)
    kind = vocab_kind(spec)
    if kind is None:
        log.warning("tokenizer.json: model %r with this pre-tokenizer has no llama.cpp equivalent "
                    "(supported: BPE, byte-level or SentencePiece-style); stored as HF json only",
                    (spec.get("model") or {}).get("type"))
    else:
        try:
            fields.update(vocab_fields(spec, kind, n_vocab))
        except ValueError as exc:  # the HF json alone still tokenizes exactly
            log.warning("%s; stored as HF json only", exc)
    fields.update(special_token_fields(tok, config, fallback_ids or {}))
    template = chat_template if chat_template is not None else config.get("chat_template")
    if isinstance(template, str) and template:
        fields[K.CHAT_TEMPLATE] = template
    return fields


def _components(node: Any, list_key: str) -> Iterator[dict]:
    """The steps of a normalizer / pre-tokenizer / decoder, flattening ``Sequence`` nodes."""
    if not isinstance(node, dict):
        return
    if node.get("type") == "Sequence":
        for sub in node.get(list_key) or []:
            yield from _components(sub, list_key)
    else:
        yield node


def _pre_tokenizer_steps(spec: Mapping[str, Any]) -> list[dict]:
    return list(_components(spec.get("pre_tokenizer"), "pretokenizers"))


def _normalizer_steps(spec: Mapping[str, Any]) -> list[dict]:
    return list(_components(spec.get("normalizer"), "normalizers"))


def vocab_kind(spec: Mapping[str, Any]) -> str | None:
    """'gpt2' (byte-level BPE), 'llama' (SentencePiece-style BPE) or None (no llama.cpp equivalent)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    steps = {s.get("type") for s in _pre_tokenizer_steps(spec)}
    decoders_ = {s.get("type") for s in _components(spec.get("decoder"), "decoders")}
    if "ByteLevel" in steps or "ByteLevel" in decoders_:
        return "gpt2"
    norm = {s.get("type") for s in _normalizer_steps(spec)}
    if model.get("byte_fallback") or "Metaspace" in steps or "Prepend" in norm:
        return "llama"
    return None


def _hf_merges(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The BPE merges of tokenizer.json, old ("a b") or new (["a", "b"]) format."""
    out = []
    for m in (spec.get("model") or {}).get("merges") or []:
        out.append(tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]))
    return out  # type: ignore[return-value]


def _tokens_and_types(spec: Mapping[str, Any], kind: str, n_vocab: int | None) -> tuple[list[str], list[int]]:
    """Tokens by id (holes and the tail up to n_vocab padded with [PADi]) and llama.cpp types."""
    by_id: dict[int, str] = {int(i): t for t, i in (spec.get("model") or {}).get("vocab", {}).items()}
    added = {int(a["id"]): a for a in spec.get("added_tokens") or []}
    for i, a in added.items():
        by_id[i] = a["content"]
    size = max([n_vocab or 0, *(i + 1 for i in by_id)])
    unk = (spec.get("model") or {}).get("unk_token")
    tokens, types = [], []
    for i in range(size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]"), types.append(TOKEN_UNUSED)
            continue
        tokens.append(t)
        if t == unk:
            types.append(TOKEN_UNKNOWN)
        elif i in added:
            types.append(TOKEN_CONTROL if added[i].get("special") else TOKEN_USER_DEFINED)
        elif kind == "llama" and _BYTE_TOKEN.fullmatch(t):
            types.append(TOKEN_BYTE)
        else:
            types.append(TOKEN_NORMAL)
    return tokens, types


def _spm_scores(tokens: list[str], types: list[int], merges: list[tuple[str, str]]) -> list[float]:
    """Scores that make score-ranked merging (SentencePiece / llama.cpp) follow the HF merge order:
    a piece scores minus the rank of the first merge producing it."""
    rank: dict[str, int] = {}
    for r, (a, b) in enumerate(merges):
        rank.setdefault(a + b, r)
    out = []
    for t, ty in zip(tokens, types):
        if t in rank:
            out.append(-float(rank[t]))
        else:
            out.append(NO_MERGE_SCORE if ty == TOKEN_NORMAL and len(t) > 1 else 0.0)
    return out


def _spm_options(spec: Mapping[str, Any]) -> tuple[str, bool]:
    """(prepend scheme, Metaspace split) of an SPM-style tokenizer.json."""
    if any(s.get("type") == "Prepend" for s in _normalizer_steps(spec)):
        return "legacy", False
    for s in _pre_tokenizer_steps(spec):
        if s.get("type") == "Metaspace":
            scheme = s.get("prepend_scheme") or ("always" if s.get("add_prefix_space", True) else "never")
            return str(scheme), bool(s.get("split", True))
    return "never", False


def vocab_fields(spec: Mapping[str, Any], kind: str, n_vocab: int | None = None) -> dict[str, Any]:
    """llama.cpp-style vocabulary fields of a BPE tokenizer.json of ``kind`` ('gpt2' or 'llama')."""
    tokens, types = _tokens_and_types(spec, kind, n_vocab)
    merges = _hf_merges(spec)
    # GGUF stores a merge as "a b": a piece holding a space cannot be written that way
    merge_strs = None if any(" " in a or " " in b for a, b in merges) else [f"{a} {b}" for a, b in merges]
    f: dict[str, Any] = {K.TOK_MODEL: kind, K.TOK_TOKENS: tokens, K.TOK_TYPES: types}
    if kind == "gpt2":
        if merge_strs is None:
            raise ValueError("tokenizer.json: a merge holds a space, which GGUF's 'a b' merges cannot store")
        level = [s for s in _pre_tokenizer_steps(spec) if s.get("type") == "ByteLevel"]
        f[K.TOK_MERGES] = merge_strs
        f[K.TOK_PRE] = "default"
        f[K.TOK_ADD_SPACE_PREFIX] = bool(level and level[0].get("add_prefix_space", False))
        if not (level and level[0].get("use_regex", True)) or len(_pre_tokenizer_steps(spec)) != 1:
            log.warning("tokenizer.json: pre-tokenizer is not plain GPT-2 ByteLevel; the llama.cpp-style "
                        "fields approximate it (the stored HF json is exact)")
        return f
    scheme, split = _spm_options(spec)
    f[K.TOK_SCORES] = _spm_scores(tokens, types, merges)
    if merge_strs is not None:
        f[K.TOK_MERGES] = merge_strs  # exact; llama.cpp ignores merges of a 'llama' vocab
    f[K.TOK_ADD_SPACE_PREFIX] = scheme != "never"
    f[K.TOK_SPM_PREPEND] = scheme
    f[K.TOK_SPM_SPLIT] = split
    return f


def _token_content(v: Any) -> str | None:
    """tokenizer_config.json names a token as a string or as {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _post_processor_adds(tok: HFTokenizer) -> tuple[list[int], list[int]]:
    """The ids HF's post-processor puts before and after a text's own ids."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


def special_token_fields(tok: HFTokenizer, config: Mapping[str, Any],
                         fallback_ids: Mapping[str, Any]) -> dict[str, Any]:
    """bos/eos/unk/pad ids and add_bos/add_eos as the HF tokenizer uses them."""
    f: dict[str, Any] = {}
    for key, name in ((K.TOK_BOS, "bos"), (K.TOK_EOS, "eos"), (K.TOK_UNK, "unk"), (K.TOK_PAD, "pad")):
        content = _token_content(config.get(f"{name}_token"))
        tid = tok.token_to_id(content) if content is not None else None
        if tid is None:
            fb = fallback_ids.get(f"{name}_token_id")
            tid = fb[0] if isinstance(fb, list) and fb else fb
        if isinstance(tid, int) and 0 <= tid < tok.get_vocab_size(with_added_tokens=True):
            f[key] = int(tid)
    before, after = _post_processor_adds(tok)
    f[K.TOK_ADD_BOS] = len(before) == 1
    f[K.TOK_ADD_EOS] = len(after) == 1
    if len(before) == 1:
        f[K.TOK_BOS] = before[0]
    if len(after) == 1:
        f[K.TOK_EOS] = after[0]
    return f
