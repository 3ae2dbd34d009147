"""Activation profiling through the engine itself (``powerinfer-ray profile --engine``): the
corpus's token windows (``offline.stream.token_windows``, as the single-device profile reads
them) run as prompts through an in-process engine under policy 'oracle', at any placement the
engine can run (a VRAM budget, a GPU fraction), and the engine's own counts
(``runtime.activity``) are the profile. A model larger than one device is profiled at the
engine's prefill speed; the counts are the single-device profile's on the same windows but for
decisions on activations within fp32 rounding of zero (the engine's sums add in another order).

Windows are independent sequences: up to ``slots`` of them go through each step together, in
chunks of the engine's prefill size (B * T tokens a step, at most the channel's ``t_max``).
"""
from __future__ import annotations

import dataclasses
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

from ..offline.corpus import Corpus, iter_texts
from ..offline.profile import ActivationStats, write_profile
from ..offline.stream import StreamFormat, token_windows
from .config import EngineConfig
from .engine import LocalEngine, make_tokenizer
from .primary import PrimaryExecutor


def profile_with_engine(ec: EngineConfig, corpus: Corpus, max_tokens: int = 100_000, seq_len: int = 256,
                        progress: bool = True, fmt: StreamFormat | None = None) -> ActivationStats:
    """Count active FFN neurons over up to ``max_tokens`` tokens of ``corpus``'s token stream, in
    independent windows of ``seq_len``, with an engine of config ``ec`` (its policy: 'oracle')."""
    eng = LocalEngine(oracle_config(ec, "activation profiles"))
    try:
        return profile_engine(eng, corpus, max_tokens, seq_len, progress, fmt)
    finally:
        eng.close()


def profile_engine(eng: LocalEngine, corpus: Corpus, max_tokens: int = 100_000, seq_len: int = 256,
                   progress: bool = True, fmt: StreamFormat | None = None) -> ActivationStats:
    """``profile_with_engine`` on an engine already open under policy 'oracle' (for a caller that
    times the windows apart from the load): its counts start afresh, so the profile is the
    windows' alone."""
    if eng.primary.policy.name != "oracle":
        raise ValueError(f"policy {eng.primary.policy.name!r}: an activation profile counts the true activations, "
                         "policy 'oracle'; open the engine with oracle_config(...)")
    tok = make_tokenizer(eng.primary.src.fields)
    if tok is None:
        raise ValueError(f"model {eng.config.model!r} has no tokenizer: the corpus cannot be encoded")
    seq_len = min(seq_len, eng.primary.weights.n_ctx)
    eng.activation_stats(reset=True)
    windows = token_windows(tok, iter_texts(corpus), seq_len, max_tokens, fmt)
    step_windows(eng.primary, windows, seq_len, max_tokens if progress else None)
    stats = eng.activation_stats()
    if stats.n_tokens == 0:
        raise ValueError(f"corpus {corpus!r} gave no window of {seq_len} tokens")
    return stats


def oracle_config(ec: EngineConfig, what: str) -> EngineConfig:
    """``ec`` under policy 'oracle', which ``what`` through the engine needs; ValueError for
    another policy."""
    if ec.policy not in (None, "oracle"):
        raise ValueError(f"policy={ec.policy!r}: {what} through the engine are the true activations, policy "
                         "'oracle'; leave the policy out")
    return dataclasses.replace(ec, policy="oracle")


def window_n_ctx(model: str, seq_len: int, n_ctx: int | None) -> int:
    """The engine's context for windows of ``seq_len``: ``n_ctx`` when given, else one window (at
    most the model's context): no window is longer, and a longer KV cache takes VRAM from neurons."""
    from ..model.source import open_model

    return n_ctx or min(seq_len, open_model(model).config.n_ctx)


def run_engine_profile(ec: EngineConfig, corpus: Corpus, out_dir: str | Path, max_tokens: int = 100_000,
                       seq_len: int = 256, progress: bool = True, plot: bool = True,
                       fmt: StreamFormat | None = None) -> ActivationStats:
    """``profile_with_engine``, then the files and table of the single-device profile
    (``offline.profile.write_profile``)."""
    return write_profile(profile_with_engine(ec, corpus, max_tokens, seq_len, progress, fmt), out_dir, plot)


def window_shape(seq_len: int, t_max: int, slots: int) -> tuple[int, int]:
    """(windows per step B, tokens per window and step T): T the whole window when it fits the
    step, B as many windows as fit beside it (at most the KV cache's slots)."""
    T = min(seq_len, t_max)
    return max(1, min(slots, t_max // T)), T


def step_windows(primary: PrimaryExecutor, windows: Iterable[list[int]], seq_len: int,
                total: int | None = None, desc: str = "profiling (engine)") -> int:
    """Every window (``seq_len`` tokens each) as a prompt of its own slot, from position 0; a
    progress bar titled ``desc`` over ``total`` tokens when given. Returns the tokens run. The
    windows' tokens run in their order (a window's chunks in turn, whole windows side by side)."""
    B, T = window_shape(seq_len, primary.t_max, primary.weights.slots)
    bar = None
    if total is not None:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True)
    n = 0
    for batch in _batches(windows, B):
        for start in range(0, seq_len, T):
            primary.step(list(range(len(batch))), [w[start:start + T] for w in batch], [start] * len(batch))
        n += seq_len * len(batch)
        if bar is not None:
            bar.update(seq_len * len(batch))
    if bar is not None:
        bar.close()
    return n


def _batches(items: Iterable[list[int]], size: int) -> Iterator[list[list[int]]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch
