"""``powerinfer-ray inspect``: a model file's metadata, config and tensors as text."""
from __future__ import annotations

from dataclasses import asdict

from .gguf_file import ModelFile

_LONG = 8  # array metadata longer than this is summarised


def describe(path: str, tensors: bool = False) -> str:
    mf = ModelFile(path)
    lines = [f"file: {mf.path} ({mf.path.stat().st_size / 2**20:.1f} MiB, magic {mf.magic.decode()})", "config:"]
    for k, v in asdict(mf.config).items():
        if k != "extra":
            lines.append(f"  {k} = {v}")
    lines.append("metadata:")
    for k, v in mf.fields.items():
        if isinstance(v, list) and len(v) > _LONG:
            v = f"[{len(v)} items: {v[:3]} ...]"
        elif isinstance(v, str) and len(v) > 80:
            v = v[:77] + "..."
        lines.append(f"  {k} = {v}")
    total = sum(int(t.n_bytes) for t in mf.tensors.values())
    lines.append(f"tensors: {len(mf.tensors)}, {total / 2**20:.1f} MiB")
    if tensors:
        for name in mf.tensors:
            lines.append(f"  {name:32s} {mf.dtype_of(name):5s} {list(mf.shape(name))}")
    return "\n".join(lines)
