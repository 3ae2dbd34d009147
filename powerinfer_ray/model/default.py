"""The embedded default model: the trained tiny ReGLU model shipped as package data, or, where
it is absent, a seeded tiny model built on the fly into a temporary folder of the user's."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TRAINED_NAME = "tiny-reglu.powerinfer.gguf"


def _seeded_dir() -> Path:
    root = Path(tempfile.gettempdir()) / f"powerinfer-ray-{os.getuid()}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def default_model_path() -> Path:
    """Path of the default model file (the trained tiny model when packaged)."""
    trained = DATA_DIR / TRAINED_NAME
    if trained.exists():
        return trained
    from .tiny import write_tiny_model

    path = _seeded_dir() / "seeded-tiny-reglu.gguf"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent processes never read a partial file
        write_tiny_model(tmp, "llama-reglu", seed=0, n_embd=128, n_layer=4, n_ff=512, n_ctx=512,
                         predictor_rank=32)
        tmp.replace(path)
    return path
