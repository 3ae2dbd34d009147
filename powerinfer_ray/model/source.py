"""Where weights come from: a GGUF file on disk, or a planted synthetic model generated on demand.

Executors never see the difference: both satisfy ``WeightSource`` and hand out only the rows an
executor asks for: in float (``layer``, ``global_``; block-quantized matrices dequantized), and
for the matrices ``qtype`` names as Q8_0 / Q4_0 blocks (``layer_blocks``, ``global_blocks``: a
``quants.QuantRows`` of uint8 [n_rows, n_cols / 32 * block_bytes], ggml blocks row by row, what
the quantized kernels take). ``open_model`` turns a user's model argument into a source:
a path -> ``ModelFile``; ``planted:<shape>[?key=value&...]`` -> ``bench.planted`` generator
(e.g. ``planted:llama2-13b?dtype=f16&seed=0``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from .config import ModelConfig
from .gguf_file import ModelFile
from .quants import QuantRows

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

    def dtype_of(self, name: str) -> str: ...  # storage: f32 | f16 | bf16 | q8_0 | q4_0 | q6_k

    def qtype(self, template: str, bid: int | None = None, bias: bool = False) -> str | None: ...

    def layer_blocks(self, template: str, bid: int, rows: Any = None,
                     device: str | torch.device = "cpu") -> QuantRows: ...

    def global_blocks(self, name: str, rows: Any = None, device: str | torch.device = "cpu") -> QuantRows: ...


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
