"""Planted models as GGUF files, written once, so benchmarks run every engine from a file as users do.

    python bench/planted_file.py "llama2-13b?dtype=f16" --dir /dev/shm    # -> /dev/shm/llama2-13b-f16.gguf

The file is named by its spec (preset, dtype, the options that differ from the defaults) and
records the spec in its metadata; a file that exists and records the same spec is used as it is.
Otherwise the model is written tensor by tensor (one tensor in memory at a time; generated on the
GPU when there is one, which is many times faster than the host's cores) to ``<name>.partial``
with a progress bar, and renamed when complete. Beside it go the planted activation statistics:
``<stem>.activation.parquet`` (what the engine's placement reads) and upstream's
``<stem>.activation/activation_{l}.pt``. The last line printed is the file's path.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from powerinfer_ray.model import gguf_keys as K
from powerinfer_ray.model.gguf_file import ModelFileError
from powerinfer_ray.model.planted import PlantedModel, parse_spec
from powerinfer_ray.model.qtypes import tensor_bytes
from powerinfer_ray.model.source import PLANTED_PREFIX

N_TOKENS = 100_000  # the statistics' token count: what the engine uses for a planted model
HEADER_BYTES = 16 << 20  # room for the metadata (the tokenizer) and alignment padding


def canonical(spec: str) -> str:
    """The spec with only the options that differ from the defaults, in a fixed order."""
    s = parse_spec(spec.removeprefix(PLANTED_PREFIX))
    default = type(s)(s.preset)
    opts = [f"{k}={getattr(s, k)}" for k in ("dtype", "seed", "layers", "active", "marked", "top_share", "rho",
                                             "pred_dtype", "qkv", "ranges")
            if k == "dtype" or getattr(s, k) != getattr(default, k)]
    return f"{s.preset}?{'&'.join(opts)}"


def file_name(spec: str) -> str:
    """``llama2-13b?dtype=f16`` -> ``llama2-13b-f16.gguf``; other options follow as -key+value."""
    preset, _, query = canonical(spec).partition("?")
    parts = [preset] + [v if k == "dtype" else f"{k}{v}" for k, v in (kv.split("=") for kv in query.split("&"))]
    return "-".join(parts) + ".gguf"


class _OnDevice(PlantedModel):
    """The planted model with every tensor generated on ``device`` (the writer copies it to the host)."""

    def __init__(self, spec: str, device: str) -> None:
        super().__init__(spec)
        self.device = device

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        return super().get(name, dtype, self.device)


def file_bytes(model: PlantedModel) -> int:
    """The file's size, near enough: every tensor as it is stored, plus the header's room."""
    return HEADER_BYTES + sum(tensor_bytes(model.dtype_of(name), shape) for name, shape in model.shapes.items())


def matches(path: Path, spec: str) -> bool:
    """Whether ``path`` is a complete model file of ``spec`` (the header checks truncation)."""
    from powerinfer_ray.model.gguf_file import ModelFile

    if not path.exists():
        return False
    try:
        return ModelFile(path, validate=False).meta(K.PLANTED_SPEC) == canonical(spec)
    except ModelFileError:
        return False


def planted_file(spec: str, folder: str | Path, device: str | None = None, progress: bool = True) -> Path:
    """The file of ``spec`` in ``folder``, written unless a matching one is there (module docstring).
    ValueError, naming the sizes, when the folder's file system lacks the room."""
    spec = canonical(spec)
    path = Path(folder) / file_name(spec)
    if matches(path, spec):
        print(f"{path} exists and holds {spec}: not written", flush=True)
        return path
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = _OnDevice(spec, device)
    need = file_bytes(model)
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize + (path.stat().st_size if path.exists() else 0)
    if need > free:
        raise ValueError(f"{path}: the planted model {spec} takes {need / 2**30:.1f} GiB, {path.parent} has "
                         f"{free / 2**30:.1f} GiB free (of {st.f_blocks * st.f_frsize / 2**30:.1f} GiB): free room "
                         "or choose another --dir")
    path.unlink(missing_ok=True)
    model.fields[K.PLANTED_SPEC] = spec
    partial = path.with_name(path.name + ".partial")
    stem = path.name.split(".")[0]
    t0 = time.perf_counter()
    from powerinfer_ray.model.planted import write_planted_gguf
    from powerinfer_ray.placement.stats import write_activation_parquet

    write_planted_gguf(model, partial, progress=progress, stats_dir=path.parent / f"{stem}.activation",
                       n_tokens=N_TOKENS)
    write_activation_parquet(path.parent / f"{stem}.activation.parquet", *model.activation_counts(N_TOKENS),
                             {"model": spec})
    os.replace(partial, path)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s "
          f"(generated on {device})", flush=True)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python bench/planted_file.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="a planted spec, e.g. 'llama2-13b?dtype=f16' (with or without planted:)")
    ap.add_argument("--dir", default="/dev/shm", help="where the file goes (default /dev/shm)")
    ap.add_argument("--device", default=None, help="where the rows are generated (default: cuda if present)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--check", action="store_true", help="only say whether the file is there (exit 1 if not)")
    a = ap.parse_args(argv)
    if a.check:
        path = Path(a.dir) / file_name(a.spec)
        ok = matches(path, a.spec)
        print(f"{path} {'holds' if ok else 'is missing or does not hold'} {canonical(a.spec)}")
        return 0 if ok else 1
    print(planted_file(a.spec, a.dir, a.device, not a.no_progress), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
