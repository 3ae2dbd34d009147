"""Sampling parameters (validated at the edge) and the sampler: greedy, temperature, top-k, top-p."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "SamplingParams":
        """Build from user keyword arguments; unknown names and bad values raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; expected some of {sorted(known)}")
        kw = {k: v for k, v in kw.items() if v is not None or k == "seed"}
        if isinstance(kw.get("stop"), str):
            kw["stop"] = [kw["stop"]]
        p = cls(**kw)
        p.validate()
        return p

    def validate(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"{name} is {getattr(self, name)!r}, expected {expected}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "a number in [0, 100]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "an integer or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a string or a list of non-empty strings")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of integers")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g


def sample(logits: np.ndarray | torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token id from logits [V] under p."""
    x = torch.as_tensor(logits, dtype=torch.float32)
    if p.temperature == 0.0:
        return int(x.argmax())
    x = x / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p  # the smallest prefix reaching top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
