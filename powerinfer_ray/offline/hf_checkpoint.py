"""The inputs of a conversion: an HF model folder's ``config.json`` and its safetensors checkpoint
(single file or sharded with ``model.safetensors.index.json``), read lazily, one tensor at a time."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from ..model.gguf_writer import LazyTensor

log = logging.getLogger(__name__)

_MISSING = object()


class ConvertError(ValueError):
    """An HF checkpoint that cannot be converted; the message names the file and the field."""


@dataclass
class HFConfig:
    """config.json of an HF model, with errors that name the file and the field."""

    path: Path
    data: dict[str, Any]

    @classmethod
    def read(cls, hf_dir: Path) -> "HFConfig":
        path = hf_dir / "config.json"
        if not path.is_file():
            raise ConvertError(f"{path}: no such file; expected an HF model folder with config.json "
                               "and safetensors weights")
        try:
            return cls(path, json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{path}: not valid JSON ({exc})") from None

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """The first of ``names`` present (aliases, e.g. falcon's 'n_head'), else ``default``."""
        for n in names:
            if self.data.get(n) is not None:
                return self.data[n]
        if default is _MISSING:
            raise ConvertError(f"{self.path}: field {names[0]!r} is missing")
        return default

    def error(self, name: str, got: Any, expected: str) -> ConvertError:
        return ConvertError(f"{self.path}: {name} is {got!r}; {expected}")

    def require(self, name: str, ok: bool, got: Any, expected: str) -> None:
        if not ok:
            raise self.error(name, got, expected)


class Checkpoint:
    """The safetensors tensors of an HF model folder, opened lazily, one tensor at a time."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = hf_dir
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self._files():
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    self.file_of[name] = path
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())
        self._cached: tuple[str, torch.Tensor] | None = None
        self.used: set[str] = set()  # names the plan reads

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index}: field 'weight_map' is missing or empty")
            files = sorted({self.dir / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ConvertError(f"{index}: lists shard {f.name!r}, which is missing from {self.dir}")
            return files
        single = self.dir / "model.safetensors"
        if single.is_file():
            return [single]
        raise ConvertError(f"{self.dir}: no model.safetensors or model.safetensors.index.json (PyTorch "
                           ".bin checkpoints are not supported: re-save with save_pretrained(..., "
                           "safe_serialization=True))")

    def name(self, hf_name: str) -> str:
        """The stored name of ``hf_name``, with or without the 'model.' prefix of *ForCausalLM."""
        for cand in (hf_name, "model." + hf_name, hf_name.removeprefix("model.")):
            if cand in self.file_of:
                return cand
        raise ConvertError(f"{self.dir}: missing tensor {hf_name!r} in the checkpoint "
                           f"({len(self.file_of)} tensors in {sorted({p.name for p in self.file_of.values()})})")

    def has(self, hf_name: str) -> bool:
        try:
            self.name(hf_name)
        except ConvertError:
            return False
        return True

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return self.shapes[self.name(hf_name)]

    def load(self, hf_name: str) -> torch.Tensor:
        """One tensor from its shard (the last one stays cached: falcon splits it three ways)."""
        name = self.name(hf_name)
        if self._cached is None or self._cached[0] != name:
            with safe_open(self.file_of[name], framework="pt") as f:
                self._cached = (name, f.get_tensor(name))
        return self._cached[1]

    def lazy(self, hf_name: str, outtype: str, fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
             shape: tuple[int, ...] | None = None) -> LazyTensor:
        """A tensor read (and transformed by ``fn``) when the writer reaches it; matrices are
        stored at ``outtype``, 1-D tensors (norms, biases) at f32."""
        shape = tuple(shape if shape is not None else self.shape(hf_name))
        kind = outtype if len(shape) >= 2 else "f32"
        self.used.add(self.name(hf_name))
        return LazyTensor(shape, kind, lambda: fn(self.load(hf_name)) if fn else self.load(hf_name))

    def warn_unused(self) -> None:
        """Tensors of the checkpoint that no GGUF tensor reads, beyond the known redundant ones,
        mean the model has parts this converter does not know: say so."""
        redundant = re.compile(r".*rotary_emb\.inv_freq|(model\.)?lm_head\.weight")  # buffers; tied head
        unused = sorted(n for n in self.file_of if n not in self.used and not redundant.fullmatch(n))
        if unused:
            log.warning("%s: %d checkpoint tensors are not converted: %s", self.dir, len(unused),
                        ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else ""))


def const(shape: tuple[int, ...], value: float) -> LazyTensor:
    """A constant 1-D tensor (OPT's LayerNorm without elementwise affine: weight 1, bias 0)."""
    return LazyTensor(shape, "f32", lambda: torch.full(shape, value, dtype=torch.float32))

