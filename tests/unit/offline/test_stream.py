"""The token stream: documents joined as the model was trained, cut into windows with a BOS only
at a window's start or between documents; text files as one document; held-out splits."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFile
from powerinfer_ray.model.tokenizer import Tokenizer, byte_level_fields
from powerinfer_ray.offline.corpus import Piece, _text_pieces, frozen_documents, iter_texts
from powerinfer_ray.offline.stream import (StreamFormat, split_heldout, stream_array, stream_pieces,
                                           token_windows)
from powerinfer_ray.offline.train_tiny import trained_model_path

BYTES = Tokenizer(byte_level_fields())  # byte b is token b; <s> 256, </s> 257
BOS, EOS = 256, 257


def b(text: str) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize("sep, between", [("bos", [BOS]), ("eos", [EOS]), ("eos+bos", [EOS, BOS]),
                                          ("blank-line", b("\n\n")), ("none", [])])
def test_documents_join_with_the_separator_only_between_them(sep, between):
    docs = ["abc", "de", "fgh"]
    stream = b("abc") + between + b("de") + between + b("fgh")
    windows = list(token_windows(BYTES, docs, 4, fmt=StreamFormat(sep, window_bos=False)))
    assert windows == [stream[i:i + 4] for i in range(0, len(stream) - 3, 4)]


def test_window_bos_starts_every_window_and_is_never_doubled():
    docs = ["abc", "defgh", "ij"]  # the stream: a b c <s> d e f g h <s> i j
    got = list(token_windows(BYTES, docs, 4, fmt=StreamFormat("bos", window_bos=True)))
    # 3 stream tokens per window; the separator <s> that falls at the second window's start is
    # its BOS; the one inside the third separates two documents; "ij" is a partial window
    assert got == [[BOS] + b("abc"), [BOS] + b("def"), [BOS] + b("gh") + [BOS]]
    # the budget counts window tokens; the last partial window is dropped
    assert list(token_windows(BYTES, docs, 4, max_tokens=7, fmt=StreamFormat("bos", True))) == got[:1]


def test_defaults_come_from_the_file_then_the_tokenizer():
    assert StreamFormat().resolve(BYTES) == StreamFormat("bos", True)  # add_bos: Llama-style
    gpt2 = Tokenizer({**byte_level_fields(), K.TOK_ADD_BOS: False})
    assert StreamFormat().resolve(gpt2) == StreamFormat("eos", False)  # GPT-2 style
    trained = Tokenizer({**byte_level_fields(), K.STREAM_DOC_SEP: "bos", K.STREAM_WINDOW_BOS: False})
    assert StreamFormat().resolve(trained) == StreamFormat("bos", False)
    assert StreamFormat(window_bos=True).resolve(trained) == StreamFormat("bos", True)  # flags win
    no_bos = Tokenizer({k: v for k, v in byte_level_fields().items() if k not in (K.TOK_BOS, K.TOK_ADD_BOS)})
    with pytest.raises(ValueError, match="no BOS token"):
        StreamFormat("bos").resolve(no_bos)
    with pytest.raises(ValueError, match="doc_sep 'paragraph'"):
        StreamFormat("paragraph")


def test_a_text_file_is_one_document_read_in_pieces(tmp_path):
    """Blank lines are kept and a file read in small pieces gives the tokens of the whole file
    (byte-level BPE of the embedded model: merges across a cut would show)."""
    tok = Tokenizer(ModelFile(trained_model_path()).fields)
    text = "\n\n".join(frozen_documents("heldout")[:30]) + "\n"
    path = tmp_path / "c.txt"
    path.write_text(text)
    assert list(iter_texts(path)) == [text]
    pieces = list(_text_pieces(path, piece_chars=500))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert not isinstance(pieces[0], Piece) and all(isinstance(p, Piece) for p in pieces[1:])
    fmt = StreamFormat("bos", False)
    ids = [i for part, _ in stream_pieces(tok, pieces, fmt) for i in part]
    assert ids == tok.encode(text, add_bos=False)


def test_records_are_documents(tmp_path):
    docs = ["first record", "second\n\nrecord", "third"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet")
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i}.txt").write_text(d)
    fmt = StreamFormat("bos", False)
    want = b(docs[0]) + [BOS] + b(docs[1]) + [BOS] + b(docs[2])
    for corpus in (docs, tmp_path / "c.jsonl", tmp_path / "c.parquet", folder):
        arr, starts = stream_array(BYTES, iter_texts(corpus), fmt, 1000)
        assert arr.tolist() == want, corpus
        assert starts.tolist() == [0, len(docs[0]), len(docs[0]) + 1 + len(docs[1])]


def test_builtin_sources():
    pydoc = frozen_documents(source="pydoc")
    stdlib = frozen_documents(source="stdlib")
    assert len(pydoc) + len(stdlib) == len(frozen_documents()) and len(pydoc) < len(stdlib)
    assert sorted(iter_texts("builtin:pydoc:heldout")) == sorted(frozen_documents("heldout", source="pydoc"))
    with pytest.raises(ValueError, match="builtin\\[:pydoc"):
        list(iter_texts("builtin:python"))


def test_heldout_is_the_last_documents():
    arr = np.arange(100, dtype=np.int32)
    starts = np.array([0, 30, 60, 85])
    train, held = split_heldout(arr, starts, 20)
    assert held.tolist() == list(range(60, 100)) and train.tolist() == list(range(60))  # cut at a start
    train, held = split_heldout(arr, np.array([0]), 20)  # one document: cut inside it
    assert len(held) == 20 and len(train) == 80
    with pytest.raises(ValueError, match="heldout_tokens"):
        split_heldout(arr, starts, 100)


def test_training_tokens_stay_within_max_tokens_when_the_corpus_gives_the_heldout_text(tmp_path):
    """train-predictors without --heldout: the held-out text is the corpus's last documents (from
    the document start at or before HELDOUT_SHARE of what was read, when that is less than
    heldout_tokens); the training tokens are the stream's start, never more than max_tokens."""
    from powerinfer_ray.offline.predictors import HELDOUT_SHARE, _token_split

    fmt = StreamFormat(doc_sep="eos", window_bos=False)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(200)))
    arr, _ = stream_array(BYTES, iter_texts(str(corpus)), fmt, 4000 + 8192)
    train, held = _token_split(BYTES, str(corpus), None, fmt, 4000, 8192, 64)
    assert len(train) == 4000 and np.array_equal(train, arr[:4000])
    assert len(held) >= int(HELDOUT_SHARE * len(arr)) and np.array_equal(held, arr[len(arr) - len(held):])
