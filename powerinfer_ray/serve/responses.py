"""The engine's results -> OpenAI's response objects and stream chunks (completions and chat),
with ``n`` choices, log-probabilities, ``echo`` and usage."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    """Chat's ``logprobs`` object from the engine's entries {"token", "logprob", "top"}."""
    def item(e: dict) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8", "replace"))}

    return {"content": [{**item(e), "top_logprobs": [item(a) for a in e["top"]]} for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs`` object; ``text_offset`` counts characters of the returned
    text from ``offset`` (an echoed prompt's first token has logprob None)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append(None if e["logprob"] is None else _by_text(e["top"]))
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def _by_text(alts: list[dict]) -> dict[str, float]:
    """Alternatives keyed by their text, most likely first; tokens whose texts coincide (bytes of
    one UTF-8 character, each alone "\ufffd") keep the most likely one's log-probability."""
    out: dict[str, float] = {}
    for a in alts:
        out.setdefault(a["token"], a["logprob"])
    return out


@dataclass
class ResponseFormat:
    """OpenAI's response and stream-chunk objects of one request (completion or chat)."""

    chat: bool
    id: str
    model: str
    token_ids: bool = False  # vLLM's return_token_ids extension
    logprobs: bool = False
    echo: str | None = None  # completions: the prompt text, returned before each choice's text
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # streamed characters per choice

    def _obj(self, kind: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    # --- whole responses ------------------------------------------------------------------------
    def response(self, outs: list[dict[str, Any]]) -> dict[str, Any]:
        """The response of ``n`` engine results (one per choice)."""
        choices = [self._choice(i, out) for i, out in enumerate(outs)]
        n_prompt = outs[0]["stats"]["prompt_tokens"]
        extra: dict[str, Any] = {"usage": usage(n_prompt, sum(o["stats"]["completion_tokens"] for o in outs))}
        if self.token_ids:
            extra["prompt_token_ids"] = outs[0]["prompt_token_ids"]
        return self._obj(self.kind, choices, **extra)

    def _choice(self, i: int, out: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": out["finish_reason"]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out["text"]}
        else:
            choice["text"] = (self.echo or "") + out["text"]
        if self.logprobs:
            choice["logprobs"] = self._logprobs(self._entries(out, first=True), 0)
        if self.token_ids:
            choice["token_ids"] = out["token_ids"]
        return choice

    def _entries(self, out: dict[str, Any], first: bool) -> list[dict]:
        prompt = out.get("prompt_logprobs") if self.echo is not None and first else None
        return (prompt or []) + (out.get("logprobs") or [])

    def _logprobs(self, entries: list[dict], offset: int) -> dict[str, Any]:
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    # --- stream chunks ----------------------------------------------------------------------------
    def events(self, i: int, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream chunks of choice ``i``'s engine chunk: its text delta (the echoed prompt
        first) and log-probabilities, then the finish reason; empty deltas are skipped."""
        first = i not in self._offsets
        offset = self._offsets.setdefault(i, 0)
        text = ((self.echo or "") if first else "") + chunk["text"]
        entries = self._entries(chunk, first) if self.logprobs else []
        reason, out = chunk.get("finish_reason"), []
        if text or entries or (self.token_ids and chunk["token_ids"]) or (reason and not self.chat):
            lp = self._logprobs(entries, offset) if self.logprobs else None
            out.append(self.chunk(i, text, None if self.chat else reason, ids=chunk["token_ids"], logprobs=lp))
        self._offsets[i] = offset + len(text)
        if reason and self.chat:
            out.append(self.chunk(i, None, reason))
        return out

    def chunk(self, i: int, text: str | None, finish_reason: str | None = None, role: bool = False,
              ids: list[int] | None = None, logprobs: dict | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": i, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.token_ids and ids is not None:
            choice["token_ids"] = ids
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._obj(self.chunk_kind, [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._obj(self.chunk_kind, [], usage=usage(prompt_tokens, completion_tokens))


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()
