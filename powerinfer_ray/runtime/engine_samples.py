"""Predictor training samples through the engine itself (``powerinfer-ray train-predictors
--engine``): the training windows run as prompts through an in-process engine under policy
'oracle' with every step dense on the primary (``prefill_dense_min`` 1: the CPU shard's rows
stream to the primary, ``cold.ColdRows``), at any placement the engine can run, so a model
larger than one device gives its samples at the engine's prefill speed.

The primary's eager steps hand each layer's predictor input and the activations of all its
neurons to a sink (``eager.Sink``), here the reference path's own ``CollectHooks``: the store
receives what the dense reference gives it on the same windows, in the same order (a step holds
whole windows side by side, or one window's chunks in turn: ``engine_profile.step_windows``),
within fp32 rounding (the engine's sums add in another order).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Iterable

from ..model.gguf_file import ModelFile
from ..offline.samples import CollectHooks, Collector, SampleStore, file_down_norms
from .config import EngineConfig
from .engine import LocalEngine
from .engine_profile import oracle_config, step_windows


def engine_collector(ec: EngineConfig) -> Collector:
    """``train_predictors``' ``collect``: the samples through an engine of config ``ec``
    (checked here, before the corpus is read)."""
    sample_config(ec)
    return partial(collect_with_engine, ec)


def sample_config(ec: EngineConfig) -> EngineConfig:
    """``ec`` under policy 'oracle' with every step dense on the primary; ValueError for a
    policy or a ``prefill_dense_min`` that would hide activations."""
    ec = oracle_config(ec, "predictor samples")
    if ec.prefill_dense_min not in (None, 1):
        raise ValueError(f"prefill_dense_min={ec.prefill_dense_min}: predictor samples through the engine need "
                         "every neuron's activation on the primary, in every step (prefill_dense_min 1); leave it out")
    return dataclasses.replace(ec, prefill_dense_min=1)


def collect_with_engine(ec: EngineConfig, windows: Iterable[list[int]], seq_len: int, store: SampleStore,
                        total: int | None = None, desc: str | None = None) -> int:
    """Run ``windows`` (``seq_len`` tokens each) through an engine of config ``ec`` and store
    every position's (predictor input, activation code) per layer; a progress bar titled
    ``desc`` over ``total`` tokens when given. Returns the tokens run."""
    eng = LocalEngine(sample_config(ec))
    try:
        norms = file_down_norms(ModelFile(ec.model), eng.primary.device)
        eng.primary.sample_sink = CollectHooks(store, norms).observe
        return step_windows(eng.primary, windows, seq_len, total if desc is not None else None, desc or "")
    finally:
        eng.close()
