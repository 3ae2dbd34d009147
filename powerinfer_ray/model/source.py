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
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from . import gguf_keys as K
from .config import ModelConfig
from .gguf_file import ModelFile
from .quants import QuantRows
from .staging import copy_rows

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


class Mapping(NamedTuple):
    """A model file's memory map: where it is in this process and what it maps."""

    address: int
    nbytes: int
    path: Path


def file_mapping(src: WeightSource) -> Mapping | None:
    """The memory map of a model file (None for a source without a file)."""
    if not isinstance(src, ModelFile):
        return None
    data = src.reader.data  # np.memmap of the whole file, read-only pages
    return Mapping(int(data.ctypes.data), int(data.nbytes), src.path)


def mapped_tensor(src: WeightSource, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of a model file as a torch view of the file's memory map, without a copy
    (numpy's shape: [rows, cols]; bf16 as torch.bfloat16). The pages are read-only: writing to the
    view kills the process. None when ``src`` has no file or no such tensor."""
    if not isinstance(src, ModelFile) or not src.has(name):
        return None
    return src.view(name)


def layer_rows(src: WeightSource, template: str, bid: int, rows: Any = None, dtype: torch.dtype | None = None,
               bias: bool = False, device: str | torch.device = "cpu") -> torch.Tensor:
    """``src.layer(...)`` (a copy of the rows), gathering a file's float rows straight out of its
    memory map with torch's threads (``torch.set_num_threads``), then converting them on the
    device (``staging.copy_rows``: through pinned buffers inside ``staging.pinned_staging``)."""
    view = mapped_tensor(src, K.tensor(template, bid, bias))
    if view is None or view.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return src.layer(template, bid, rows=rows, dtype=dtype, bias=bias, device=device)
    ids = None if rows is None else np.asarray(rows, np.int64)
    if ids is not None and ids.size > 0 and bool((np.diff(ids) == 1).all()) and torch.device(device).type != "cpu":
        view, ids = view[int(ids[0]):int(ids[-1]) + 1], None  # a run of rows: a slice of the map
    t = copy_rows(view, None if ids is None else torch.as_tensor(ids), device)
    return t.to(dtype or t.dtype)
