"""Prompts in, token ids out: validation and tokenization of what a request asks for, bounded so
that no prompt, however large, costs the engine more than the context can hold.

A text prompt longer than ``n_ctx`` times the longest token (in UTF-8 bytes) cannot fit in the
context whatever its tokenization, so it is refused before the tokenizer sees it (a 10 MB
prompt would take the tokenizer tens of seconds). Token-id prompts are checked against the
vocabulary: an id outside it would index past the embedding table.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ..model.tokenizer import Tokenizer


def max_token_bytes(tok: Tokenizer) -> int:
    """The longest token of the vocabulary in UTF-8 bytes of its vocabulary string (an upper bound
    on the bytes of text one token covers: byte-level and "▁" spellings are never shorter)."""
    return max((len(t.encode("utf-8", "replace")) for t in tok.tok.get_vocab()), default=1)


class PromptChecker:
    """Turns a request's prompt (text or token ids) into checked token ids for a context of
    ``n_ctx`` tokens and a vocabulary of ``n_vocab`` (None: ids are not range-checked)."""

    def __init__(self, tok: Tokenizer | None, n_ctx: int, n_vocab: int | None) -> None:
        self.tok, self.n_ctx, self.n_vocab = tok, n_ctx, n_vocab
        self.max_text_bytes = n_ctx * max_token_bytes(tok) if tok is not None else 0

    async def ids(self, prompt: Any, token_ids: list[int] | None) -> list[int]:  # noqa: ANN401
        """The prompt's token ids (tokenized in a worker thread, off the caller's event loop);
        ValueError naming ``prompt`` or ``prompt_token_ids`` on bad input."""
        if token_ids is None and isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        if token_ids is not None:
            return self.check_ids(token_ids)
        text = self.check_text(prompt)
        ids = await asyncio.to_thread(self.tok.encode, text)
        if not ids:
            raise ValueError("prompt is empty")
        self.check_length(len(ids))
        return ids

    def check_ids(self, ids: Any) -> list[int]:  # noqa: ANN401
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        self.check_length(len(ids))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        if self.n_vocab is not None:
            bad = [t for t in ids if not 0 <= t < self.n_vocab]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:8]} are outside the vocabulary [0, {self.n_vocab})")
        return list(ids)

    def check_text(self, prompt: Any) -> str:  # noqa: ANN401
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if self.tok is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        if not prompt:
            raise ValueError("prompt is empty")
        n_bytes = len(prompt)  # a lower bound on its UTF-8 bytes, free to compute
        if n_bytes <= self.max_text_bytes:
            n_bytes = len(utf8(prompt, "prompt"))
        if n_bytes > self.max_text_bytes:
            raise ValueError(f"prompt is at least {n_bytes} bytes: it cannot fit in the context of {self.n_ctx} "
                             f"tokens (no token is longer than {self.max_text_bytes // self.n_ctx} bytes); "
                             "shorten the prompt")
        return prompt

    def check_length(self, n: int) -> None:
        if n >= self.n_ctx:
            raise ValueError(f"prompt has {n} tokens; the context holds {self.n_ctx} (at most {self.n_ctx - 1} "
                             "prompt tokens): shorten the prompt")

    def check_budget(self, n_prompt: int, max_tokens: int | None) -> int:
        """The tokens this request may generate: max_tokens when prompt and completion fit in the
        context, all the context leaves when max_tokens is None; else ValueError."""
        room = self.n_ctx - n_prompt
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ValueError(f"max_tokens is {max_tokens}, but the prompt has {n_prompt} tokens and the context "
                             f"holds {self.n_ctx}: at most {room} new tokens fit; lower max_tokens (context "
                             "length exceeded)")
        return max_tokens


def utf8(text: str, name: str) -> bytes:
    """``text`` as UTF-8; a ValueError naming the field for text that has none (a lone surrogate)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode text: {exc.reason} at position {exc.start}") from None
