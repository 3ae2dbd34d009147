"""The embedded default model: the trained tiny ReGLU model shipped as package data, or, where
it is absent, a seeded tiny model built on the fly into the user's cache folder."""
from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TRAINED_NAME = "tiny-reglu.powerinfer.gguf"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "powerinfer-ray"
    root.mkdir(parents=True, exist_ok=True)
    return root


def default_model_path() -> Path:
    """Path of the default model file (the trained tiny model when packaged)."""
    trained = DATA_DIR / TRAINED_NAME
    if trained.exists():
        return trained
    from .tiny import write_tiny_model

    path = cache_dir() / "seeded-tiny-reglu.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        write_tiny_model(tmp, "llama-reglu", seed=0, n_embd=128, n_layer=4, n_ff=512, n_ctx=512,
                         predictor_rank=32)
        tmp.replace(path)
    return path
