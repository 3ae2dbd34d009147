"""Sparsified SwiGLU models for the tests: a SwiGLU model file with thresholds calibrated on the
builtin corpus (``powerinfer-ray sparsify``), by default the trained tiny SwiGLU model."""
from __future__ import annotations

from pathlib import Path

from powerinfer_ray.offline.sparsify import sparsify
from powerinfer_ray.offline.train_tiny import trained_swiglu_path


def sparsified(out: str | Path, target: float = 0.5, on: str = "gate", src: str | Path | None = None) -> Path:
    """``src`` (default: the trained tiny SwiGLU model) with per-layer thresholds for ``target``
    sparsity on criterion ``on``, calibrated on 1024 tokens, written to ``out``."""
    sparsify(src or trained_swiglu_path(), "builtin:train", out, target, on, max_tokens=1024, seq_len=64,
             log=lambda s: None)
    return Path(out)
