"""Sampling parameters (validated at the edge), the sampler (penalties, greedy, temperature,
top-k, top-p) and the log-probabilities a request may ask for."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import numpy as np
import torch

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI
NUCLEUS_FIRST = 256  # the most likely tokens where sample() looks for the nucleus first
NUCLEUS_BINS = 1024  # a wider nucleus: bins of the mass over -log(weight)
Z_CAP = 88.0  # -log(weight) beyond it (exp < 1e-38, 0 in float32) goes to the last bin


@dataclass
class SamplingParams:
    max_tokens: int | None = 64  # None: until the context is full
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    logprobs: int | None = None  # the chosen token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (prefills one token per step)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "SamplingParams":
        """Build from user keyword arguments; unknown names and bad values raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; expected some of {sorted(known)}")
        kw = {k: v for k, v in kw.items() if v is not None or k in ("seed", "max_tokens")}
        if isinstance(kw.get("stop"), str):
            kw["stop"] = [kw["stop"]]
        p = cls(**kw)
        p.validate()
        return p

    def validate(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"{name} is {getattr(self, name)!r}, expected {expected}")

        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise bad("max_tokens", "an integer >= 1 (or None: until the context is full)")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "a number in [0, 100]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}] or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_num(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v) and 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}] or null")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g


def penalize(x: torch.Tensor, p: SamplingParams, counts: torch.Tensor | None) -> torch.Tensor:
    """OpenAI's presence and frequency penalties on logits x [V], from the generated tokens'
    counts [V]: x - frequency_penalty * count - presence_penalty * (count > 0)."""
    if counts is None or not p.penalized:
        return x
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)


def sample(logits: np.ndarray | torch.Tensor, p: SamplingParams, gen: torch.Generator | None,
           counts: torch.Tensor | None = None) -> int:
    """One token id from logits [V] under p (counts [V]: the tokens generated so far): the argmax at
    temperature 0 (gen may be None), else a draw from softmax(logits / temperature) over the top_k most likely tokens
    and, of those, the nucleus: the most likely ones whose probabilities summed before each stay
    under top_p (the smallest set reaching it). One uniform number from gen per draw, through the
    inverse of the cumulative sum of the unnormalized weights, in float32 (a float64 pass allocates
    buffers of 8 bytes a token: page faults on every call at a 128k vocabulary)."""
    x = penalize(torch.as_tensor(logits, dtype=torch.float32), p, counts)
    if p.temperature == 0.0:
        return int(x.argmax())
    ids = None
    if p.top_k and p.top_k < x.numel():
        x, ids = torch.topk(x, p.top_k)  # most likely first
    w = (x - x.max()).mul_(1.0 / p.temperature).exp_()  # softmax(x / temperature) up to its sum
    if p.top_p < 1.0:
        kept_w, kept = _nucleus(x.numpy(), w.numpy(), p.top_p, p.temperature)
        w, kept = torch.from_numpy(kept_w), torch.from_numpy(kept)
        ids = kept if ids is None else ids[kept]
    c = torch.cumsum(w, 0)
    u = torch.rand((), dtype=torch.float64, generator=gen) * c[-1]
    j = min(int(torch.searchsorted(c, u.float().reshape(1), right=True)), c.numel() - 1)
    return j if ids is None else int(ids[j])


def _nucleus(x: np.ndarray, w: np.ndarray, top_p: float, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The nucleus of logits x [n] whose weights are w = exp((x - max) / temperature): its weights
    and their indices (most likely first when it lies among the NUCLEUS_FIRST most likely, or 16
    times as many, found by a partition and a sort of those; else in index order). A wider nucleus
    is found without sorting the vocabulary: a histogram of the mass over NUCLEUS_BINS bins of
    -log(w) gives the bins wholly inside it, and only the bin where it ends is sorted."""
    n = w.size
    need = top_p * float(w.sum(dtype=np.float64))
    for m in (min(n, NUCLEUS_FIRST), min(n, 16 * NUCLEUS_FIRST)):
        part = np.argpartition(x, n - m)[n - m:] if m < n else np.arange(n)
        idx = part[np.argsort(-x[part])]
        top = w[idx]
        keep = np.cumsum(top, dtype=np.float64) - top < need
        if not keep[-1] or m == n:
            return top[keep], idx[keep]
    z = np.minimum((x.max() - x) * np.float32(1.0 / temperature), np.float32(Z_CAP))  # -log(w), capped
    hi = float(z.max())
    b = np.minimum((z * np.float32(NUCLEUS_BINS / hi if hi > 0 else 0.0)).astype(np.int32), NUCLEUS_BINS - 1)
    cum = np.cumsum(np.bincount(b, weights=w, minlength=NUCLEUS_BINS))  # float64
    k = min(int(np.searchsorted(cum, need, side="left")), NUCLEUS_BINS - 1)  # the bin where it ends
    edge = np.flatnonzero(b == k)
    edge = edge[np.argsort(-x[edge])]
    ew = w[edge]
    inside = b < k
    inside[edge[np.cumsum(ew, dtype=np.float64) - ew + (cum[k - 1] if k else 0.0) < need]] = True
    idx = np.flatnonzero(inside)
    return w[idx], idx


def logprobs_of(logits: np.ndarray | torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the model's distribution (log-softmax of the raw
    logits [V], before penalties and temperature, as vLLM reports them) and the ``top`` most
    likely tokens with theirs, most likely first."""
    lp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float32), dim=-1)
    alts: list[tuple[int, float]] = []
    if top:
        vals, ids = torch.topk(lp, min(top, lp.numel()))
        alts = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return float(lp[token]), alts


@dataclass
class Burst:
    """A decode burst (``Scheduler._burst``): ``n`` decode steps that the primary runs back to back,
    choosing each sequence's next token itself as the scheduler would (``sample``): ``samplers[i]``
    is the request's parameters (no penalties: they need the tokens so far) and its generator's
    state (``torch.Generator.get_state``; None when greedy), which ``run`` hands back advanced."""

    n: int
    samplers: list[tuple[SamplingParams, torch.Tensor | None]]

    @property
    def greedy(self) -> bool:
        return all(params.temperature == 0.0 for params, _ in self.samplers)

    def run(self, step: Callable[..., np.ndarray], tokens: list[int],
            start_pos: list[int]) -> tuple[np.ndarray, list[torch.Tensor | None]]:
        """The burst over ``step(tokens [B][1], start_pos [B]) -> logits [B, V]``, from ``tokens`` [B]
        at ``start_pos``: the tokens chosen [n, B] (int64), and each sampler's generator state after.
        When every sampler is greedy, each step is asked for the argmax alone (``step(..., argmax=True)
        -> [B]``; the primary's decode graphs find it on the device)."""
        gens = [None if state is None else torch.Generator().set_state(state) for _, state in self.samplers]
        out = np.empty((self.n, len(tokens)), dtype=np.int64)
        cur, pos = list(tokens), list(start_pos)
        for j in range(self.n):
            toks = [[int(t)] for t in cur]
            if self.greedy:
                out[j] = step(toks, pos, argmax=True)
            else:
                logits = step(toks, pos)
                for i, ((params, _), g) in enumerate(zip(self.samplers, gens)):
                    out[j, i] = sample(logits[i], params, g)
            cur, pos = out[j], [p + 1 for p in pos]
        return out, [None if g is None else g.get_state() for g in gens]
