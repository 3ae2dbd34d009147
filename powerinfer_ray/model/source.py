"""Where weights come from: a GGUF file on disk, or a planted synthetic model generated on demand.

Executors never see the difference: both satisfy ``WeightSource`` and hand out only the rows an
executor asks for. ``open_model`` turns a user's model argument into a source:
a path -> ``ModelFile``; ``planted:<shape>[?key=value&...]`` -> ``bench.planted`` generator
(e.g. ``planted:llama2-13b?dtype=f16&seed=0``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from .config import ModelConfig
from .gguf_file import ModelFile

PLANTED_PREFIX = "planted:"


@runtime_checkable
class WeightSource(Protocol):
    config: ModelConfig
    fields: dict[str, Any]  # GGUF-style metadata (tokenizer, threshold, ...)

    def has(self, name: str) -> bool: ...

    def layer(self, template: str, bid: int, rows: Any = None, dtype: torch.dtype | None = None,
              bias: bool = False, device: str | torch.device = "cpu") -> torch.Tensor: ...

    def global_(self, name: str, dtype: torch.dtype | None = None, bias: bool = False) -> torch.Tensor: ...

    def output_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def open_model(spec: str | Path | WeightSource) -> WeightSource:
    """A WeightSource from a path, a ``planted:`` spec, or a source (returned as is)."""
    if isinstance(spec, WeightSource):
        return spec
    text = str(spec)
    if text.startswith(PLANTED_PREFIX):
        from .planted import planted_model  # deferred: only benchmarks need it

        return planted_model(text[len(PLANTED_PREFIX):])
    return ModelFile(text)


def rows_faster_on(src: WeightSource, device: str | torch.device) -> bool:
    """Whether ``src`` makes weight rows faster on ``device`` than on the host's CPU: a planted
    model generates its rows, many times faster on a GPU; a file's rows are read, as fast for any
    device. The engine then has the primary executor write the CPU executor's rows."""
    if isinstance(src, ModelFile) or torch.device(device).type != "cuda":
        return False
    from .planted import PlantedModel

    return isinstance(src, PlantedModel)
