"""The token stream the offline tools feed a model: documents joined as in training, in windows.

Documents (``corpus.iter_texts``) are encoded one by one without the tokenizer's own BOS/EOS
and joined into ONE stream, with a separator only between documents (``StreamFormat.doc_sep``):

- ``bos``: the model's BOS token (HF's run_clm and most pretraining pipelines: each document
  starts with BOS, so BOS separates them; the embedded tiny model was trained so);
- ``eos``: the EOS token (GPT-2 style), ``eos+bos``: both;
- ``blank-line``: the text "\\n\\n", encoded with the document that follows it;
- ``none``: documents run into each other.

A long text file is one document read in pieces (``corpus.Piece``), which continue the stream
with no separator. The stream is cut into consecutive windows of ``seq_len`` tokens. With
``window_bos`` each window is BOS followed by the next ``seq_len - 1`` stream tokens (a
separator BOS that falls at a window's start is that BOS, never doubled), as HF evaluates a
model whose tokenizer adds BOS; without it, a window is ``seq_len`` stream tokens. So a BOS sits
only at a window's start or between two documents, never inside a document.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from ..model import gguf_keys as K
from ..model.reference import FFNHooks, ReferenceModel
from ..model.tokenizer import Tokenizer
from .corpus import Piece

DOC_SEPS = ("bos", "eos", "eos+bos", "blank-line", "none")
BLANK_LINE = "\n\n"


@dataclass(frozen=True)
class StreamFormat:
    """How documents become one token stream (``doc_sep``) and the stream becomes windows
    (``window_bos``); None means: as the model's tokenizer says (``resolve``)."""

    doc_sep: str | None = None
    window_bos: bool | None = None

    def __post_init__(self) -> None:
        if self.doc_sep is not None and self.doc_sep not in DOC_SEPS:
            raise ValueError(f"doc_sep {self.doc_sep!r}: expected one of {', '.join(DOC_SEPS)}")

    def resolve(self, tok: Tokenizer) -> "StreamFormat":
        """Fill the defaults from the model file (``powerinfer_ray.stream.*``, how it was
        trained) or else from its tokenizer: BOS between documents and at each window's start
        when it adds BOS to a text (Llama-style), else EOS between documents (GPT-2 style),
        else a blank line; and check that the tokens named exist."""
        has_bos = tok.bos_id is not None
        sep = self.doc_sep or tok.fields.get(K.STREAM_DOC_SEP)
        if sep is None:
            sep = "bos" if tok.add_bos and has_bos else "eos" if tok.eos_id is not None else "blank-line"
        wb = self.window_bos if self.window_bos is not None else tok.fields.get(K.STREAM_WINDOW_BOS)
        wb = bool(tok.add_bos and has_bos) if wb is None else bool(wb)
        StreamFormat(sep, wb)  # validates a separator read from the file
        if ("bos" in sep.split("+") or wb) and not has_bos:
            raise ValueError(f"doc_sep={sep!r} / window_bos={wb}: the model's tokenizer has no BOS "
                             "token; use doc_sep 'eos', 'blank-line' or 'none' and no window BOS")
        if "eos" in sep.split("+") and tok.eos_id is None:
            raise ValueError(f"doc_sep={sep!r}: the model's tokenizer has no EOS token; use "
                             "'bos', 'blank-line' or 'none'")
        return StreamFormat(sep, wb)

    def describe(self) -> str:
        return f"documents joined by {self.doc_sep}, {'BOS + ' if self.window_bos else ''}stream tokens per window"


def separator_ids(tok: Tokenizer, sep: str) -> list[int]:
    """The tokens put between two documents for ``sep`` (the text separator is encoded with
    the next document instead)."""
    return {"bos": [tok.bos_id], "eos": [tok.eos_id], "eos+bos": [tok.eos_id, tok.bos_id]}.get(sep, [])


def stream_pieces(tok: Tokenizer, texts: Iterable[str], fmt: StreamFormat) -> Iterator[tuple[list[int], bool]]:
    """The stream in pieces: (tokens of a document or text piece, preceded by the separator
    when it is not the first document; whether it starts a document). ``fmt`` resolved."""
    sep = separator_ids(tok, fmt.doc_sep)
    first = True
    for text in texts:
        new_doc = not isinstance(text, Piece)
        if new_doc and not first and fmt.doc_sep == "blank-line":
            text = BLANK_LINE + text
        ids = tok.encode(str(text), add_bos=False, add_eos=False)
        if new_doc and not first:
            ids = sep + ids
        first = False
        if ids:
            yield ids, new_doc


def token_windows(tok: Tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int | None = None,
                  fmt: StreamFormat | None = None) -> Iterator[list[int]]:
    """Consecutive windows of ``seq_len`` tokens over the stream of ``texts`` (see the module
    docstring); at most ``max_tokens`` window tokens in all, the last partial window dropped."""
    fmt = (fmt or StreamFormat()).resolve(tok)
    return windows_of((ids for ids, _ in stream_pieces(tok, texts, fmt)), seq_len, tok.bos_id if fmt.window_bos else None, max_tokens)


def windows_of(pieces: Iterable[list[int]], seq_len: int, bos: int | None = None,
               max_tokens: int | None = None) -> Iterator[list[int]]:
    """Cut a stream given in pieces into windows of ``seq_len``; with ``bos``, each window is
    BOS + ``seq_len - 1`` stream tokens (a stream BOS at the cut is that BOS)."""
    if seq_len < 2:
        raise ValueError(f"seq_len is {seq_len}, expected at least 2 (a token and its successor)")
    buf: list[int] = []
    emitted = 0
    for ids in pieces:
        buf.extend(ids)
        while True:
            if bos is not None and buf and buf[0] == bos:
                del buf[0]
            body = seq_len - (bos is not None)
            if len(buf) < body:
                break
            if max_tokens is not None and emitted + seq_len > max_tokens:
                return
            yield ([bos] if bos is not None else []) + buf[:body]
            del buf[:body]
            emitted += seq_len


def stream_array(tok: Tokenizer, texts: Iterable[str], fmt: StreamFormat, max_tokens: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The first ``max_tokens`` tokens of the stream as int32 [N] and the offsets where
    documents start, separator included (int64 [n_docs]); ``fmt`` resolved. Tokens are cheap
    (a million take 4 MB), so a corpus can be split by document before any forward runs."""
    out: list[np.ndarray] = []
    starts: list[int] = []
    n = 0
    for ids, new_doc in stream_pieces(tok, texts, fmt):
        if new_doc:
            starts.append(n)
        take = ids[: max_tokens - n]
        out.append(np.asarray(take, dtype=np.int32))
        n += len(take)
        if n >= max_tokens:
            break
    arr = np.concatenate(out) if out else np.zeros(0, np.int32)
    return arr, np.asarray(starts, dtype=np.int64)


def array_pieces(arr: np.ndarray, piece: int = 1 << 16) -> Iterator[list[int]]:
    """A token array as ``windows_of`` pieces, a few at a time (not one list of the whole)."""
    for i in range(0, len(arr), piece):
        yield arr[i:i + piece].tolist()


def split_heldout(arr: np.ndarray, starts: np.ndarray, heldout_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(training part, held-out part) of a stream: the held-out part is its last documents,
    at least ``heldout_tokens`` tokens, cut at the last document start that gives that many
    (inside the last document when no start does, or when the cut would hold out more than
    twice ``heldout_tokens``)."""
    n = arr.shape[0]
    if heldout_tokens <= 0 or heldout_tokens >= n:
        raise ValueError(f"heldout_tokens is {heldout_tokens}, expected 1..{n - 1} for a stream of "
                         f"{n} tokens: pass a larger corpus or a held-out file")
    ok = starts[(starts > 0) & (starts <= n - heldout_tokens)]
    cut = int(ok.max()) if ok.size and n - int(ok.max()) <= 2 * heldout_tokens else n - heldout_tokens
    return arr[:cut], arr[cut:]


def run_windows(ref: ReferenceModel, windows: Iterable[list[int]], hooks: FFNHooks | None,
                total: int | None = None, desc: str | None = None) -> int:
    """The dense reference over every window (a fresh cache each), ``hooks`` looking in; a
    progress bar titled ``desc`` over ``total`` tokens when given. Returns the tokens run."""
    bar = None
    if desc is not None:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True)
    n = 0
    for window in windows:
        ref.forward(window, ref.new_cache(), hooks)
        n += len(window)
        if bar is not None:
            bar.update(len(window))
    if bar is not None:
        bar.close()
    return n
