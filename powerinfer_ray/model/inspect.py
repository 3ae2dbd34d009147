"""``powerinfer-ray inspect``: a model file's metadata, config and tensors as text."""
from __future__ import annotations

from dataclasses import asdict

from . import gguf_keys as K
from .gguf_file import ModelFile

_LONG = 8  # array metadata longer than this is summarised


def describe(path: str, tensors: bool = False) -> str:
    mf = ModelFile(path)
    lines = [f"file: {mf.path} ({mf.path.stat().st_size / 2**20:.1f} MiB, magic {mf.magic.decode()})", "config:"]
    for k, v in asdict(mf.config).items():
        if k not in ("extra", "ffn_thresholds", "ffn_threshold_on"):  # thresholds: their own table
            lines.append(f"  {k} = {v}")
    lines += thresholds_table(mf)
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


def thresholds_table(mf: ModelFile) -> list[str]:
    """The SwiGLU thresholds per layer (with the sparsity they were calibrated for), or []."""
    c = mf.config
    if not c.thresholded:
        return []
    crit = "|SiLU(gate_j)|" if c.ffn_threshold_on == "gate" else "|h_j|"
    tokens = mf.meta(K.FFN_CALIBRATION_TOKENS)
    target = mf.meta(K.FFN_TARGET_SPARSITY) or [None] * c.n_layer
    lines = [f"thresholds: neuron j active iff {crit} > t_l"
             + (f" (calibrated on {tokens} tokens)" if tokens else ""),
             f"  {'layer':>5} {'t_l':>10} {'target sparsity':>15}"]
    for l, (t, s) in enumerate(zip(c.ffn_thresholds, target)):
        lines.append(f"  {l:>5} {t:>10.4g} {'-' if s is None else f'{s:.3f}':>15}")
    return lines
