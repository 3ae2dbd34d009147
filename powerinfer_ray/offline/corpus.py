"""Text corpora for the offline tools: the frozen built-in corpus and streaming readers.

The built-in corpus is English text that ships with CPython: the ``pydoc_data.topics`` help
pages and the docstrings of the standard library's modules, classes and functions (read from
the source files with ``ast``, nothing is imported). It is built once, deterministically, and
frozen as ``powerinfer_ray/data/corpus.jsonl.gz`` (one ``{"text", "source", "split"}`` record a
line) so that every host trains on the same bytes whatever its Python version.

Readers stream documents: a text file (any name, optionally ``.gz``) is ONE document, read in
pieces of about 4 MB cut at a line end (``Piece``: the stream continues it without a
separator); JSONL records (field ``text``, one per line) and Parquet rows (column ``text``)
are documents; a folder holds the documents of its files, in name order. ``stream`` joins
documents into the token stream a model reads.
"""
from __future__ import annotations

import ast
import gzip
import io
import json
import random
import sysconfig
import warnings
from pathlib import Path
from typing import Iterable, Iterator

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_FILE = "corpus.jsonl.gz"
HELDOUT_EVERY = 20  # every 20th document (index % 20 == HELDOUT_PHASE) is held out: 5 %
HELDOUT_PHASE = 7
BUILTIN_SOURCES = {"pydoc": "pydoc_data.topics:", "stdlib": "stdlib:"}  # prefixes of "source"
PIECE_CHARS = 1 << 22  # a text file is read and encoded in pieces of about this many characters
BUILTIN_ORDER_SEED = 0
MIN_DOC_CHARS = 80  # shorter docstrings are mostly "Return x." one-liners
# stdlib folders whose docstrings are test scaffolding, not prose
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__phello__"}

Corpus = str | Path | Iterable[str]


class Piece(str):
    """A continuation of the previous document (a long text file read in pieces): joined to
    it with no separator. Pieces are cut after a newline that a non-space character follows,
    where byte-level BPE pre-tokenizers split anyway, so the tokens equal the whole file's
    (a SentencePiece tokenizer that prepends "▁" to each text adds one per piece)."""


# ------------------------------------------------------------------------------------------------
# the built-in corpus
# ------------------------------------------------------------------------------------------------
def builtin_documents() -> list[tuple[str, str]]:
    """(source, text) of every document of the built-in corpus, in a fixed order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    docs = [(f"pydoc_data.topics:{k}", topics[k].strip()) for k in sorted(topics)]
    return docs + _stdlib_docstrings(Path(sysconfig.get_paths()["stdlib"]))


def _stdlib_docstrings(root: Path) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS & set(rel.parts[:-1]):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old sources
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are Python-2 fixtures or not UTF-8
        for name, node in _documented(tree, rel.with_suffix("").as_posix().replace("/", ".")):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOC_CHARS:
                out.append((f"stdlib:{name}", doc.strip()))
    return out


def _documented(tree: ast.Module, modname: str) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of the module and every class and function, in source order."""
    yield modname, tree
    stack: list[tuple[str, ast.AST]] = [(modname, tree)]
    while stack:
        prefix, node = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}.{child.name}"
                yield qual, child
                stack.append((qual, child))


def split_of(index: int) -> str:
    return "heldout" if index % HELDOUT_EVERY == HELDOUT_PHASE else "train"


def write_frozen_corpus(path: str | Path | None = None) -> Path:
    """Build the built-in corpus and write it as gzipped JSONL (byte-identical on rebuild)."""
    path = Path(path) if path is not None else DATA_DIR / CORPUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": text, "source": src, "split": split_of(i)}, ensure_ascii=False)
             for i, (src, text) in enumerate(builtin_documents())]
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    with path.open("wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0,
                                              compresslevel=9) as gz:
        gz.write(raw)
    return path


def frozen_corpus_path() -> Path:
    path = DATA_DIR / CORPUS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: the frozen corpus is missing; rebuild it with "
                                "powerinfer_ray.offline.corpus.write_frozen_corpus()")
    return path


def frozen_documents(split: str | None = None, shuffle_seed: int | None = None,
                     source: str | None = None) -> list[str]:
    """Texts of the frozen built-in corpus; ``split`` is 'train', 'heldout' or None (all),
    ``source`` 'pydoc' (the pydoc_data.topics help pages), 'stdlib' (docstrings) or None (both).
    ``shuffle_seed`` puts them in a seeded random order (the file's order groups documents by
    stdlib module, so a prefix of it is not a sample of it)."""
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split {split!r}: expected 'train', 'heldout' or None")
    if source is not None and source not in BUILTIN_SOURCES:
        raise ValueError(f"source {source!r}: expected one of {sorted(BUILTIN_SOURCES)} or None")
    prefix = BUILTIN_SOURCES.get(source, "")
    docs = []
    with gzip.open(frozen_corpus_path(), "rt", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if (split is None or rec["split"] == split) and rec["source"].startswith(prefix):
                docs.append(rec["text"])
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(docs)
    return docs


# ------------------------------------------------------------------------------------------------
# streaming readers
# ------------------------------------------------------------------------------------------------
def iter_texts(corpus: Corpus, text_column: str = "text", split: str | None = None) -> Iterator[str]:
    """Stream the documents of ``corpus``: a path (a text file: one document, read in
    ``Piece``s; a folder: each file's documents, files in name order; .jsonl[.gz] by line with field
    ``text_column``; .parquet by batch with column ``text_column``), a built-in spec
    ``builtin[:pydoc|:stdlib][:train|:heldout]`` (the frozen corpus in a fixed shuffled order,
    so that any prefix samples all of it; ``split`` picks the part when the spec names none),
    or an iterable of strings (each one a document)."""
    if isinstance(corpus, str) and corpus.split(":")[0] == "builtin":
        source, spec_split = _builtin_spec(corpus)
        yield from frozen_documents(spec_split or split, BUILTIN_ORDER_SEED, source)
        return
    if not isinstance(corpus, (str, Path)):
        yield from corpus
        return
    path = Path(corpus)
    if not path.exists():
        raise ValueError(f"corpus {str(path)!r}: no such file (expected a text file, a folder of "
                         "them, a JSONL or Parquet file, or 'builtin')")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ValueError(f"corpus {str(path)!r}: the folder holds no files")
        for f in files:
            yield from iter_texts(f, text_column, split)
        return
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".parquet"):
        yield from _parquet_texts(path, text_column)
    elif name.endswith((".jsonl", ".json", ".ndjson")):
        yield from _jsonl_texts(path, text_column, split)
    else:
        yield from _text_pieces(path)


def _builtin_spec(spec: str) -> tuple[str | None, str | None]:
    """'builtin[:SOURCE][:SPLIT]' -> (source, split)."""
    source = split = None
    for part in spec.split(":")[1:]:
        if part in BUILTIN_SOURCES and source is None:
            source = part
        elif part in ("train", "heldout") and split is None:
            split = part
        else:
            raise ValueError(f"corpus {spec!r}: expected builtin[:pydoc|:stdlib][:train|:heldout]")
    return source, split


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _jsonl_texts(path: Path, column: str, split: str | None) -> Iterator[str]:
    with _open_text(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object per line, got a parse "
                                 f"error: {exc}") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(column), str):
                raise ValueError(f"{path}:{n}: expected a JSON object with a string field "
                                 f"{column!r}, got {str(line)[:80]!r}")
            if split is None or rec.get("split", split) == split:
                yield rec[column]


def _parquet_texts(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: expected a text column {column!r}, the file has "
                         f"{pf.schema_arrow.names}")
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


def _text_pieces(path: Path, piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """A text file as one document: its text in pieces of at least ``piece_chars`` characters,
    each cut after a newline followed by a non-space character; pieces after the first are
    ``Piece``s."""
    buf: list[str] = []
    size = 0
    first = True
    with _open_text(path) as fh:
        for line in fh:
            if size >= piece_chars and line[:1].strip():
                yield "".join(buf) if first else Piece("".join(buf))
                buf, size, first = [], 0, False
            buf.append(line)
            size += len(line)
    if buf:
        yield "".join(buf) if first else Piece("".join(buf))
