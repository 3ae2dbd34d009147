"""The CPU executor's FFN shard as a copy in one shared-memory file that the primary maps too:
for weight sources whose rows cannot be read in place (``shard.in_place_ffn_shard``: a planted
model has no file; a file of another layout). Rows of a model file are computed on where they
are, in its memory map, and need none of this.

For long prompts the primary computes the CPU shard's neurons densely, streaming their rows to
its device (``cold.ColdRows``). Mapping the CPU executor's pages saves a second host copy of the
largest thing on the host (the CPU shard of a 13B model at 16 GiB is 10.8 GiB).

The CPU executor loads its rows into one file in /dev/shm, reserved up front with
posix_fallocate (a full tmpfs would otherwise kill the writer with SIGBUS), and hands its layout
to the primary through the executor group's start script; the file's name is removed at once
and the primary opens it as /proc/<pid>/fd/<fd>, so it lives exactly as long as the two
processes map it and nothing is left behind in /dev/shm whichever dies first. Where /dev/shm
lacks the room, ``share`` returns None: the CPU executor keeps private memory and the primary
makes its own copy if RAM allows.

Sources that make rows faster on the primary's device (planted models on a GPU:
``model.source.rows_faster_on``) have ``share(..., defer=...)`` only lay the file out; the
primary makes the rows on its device and writes them in (``fill``), and the CPU executor touches
its pages once (``prefault``) before serving.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .channel import SHM_DIR
from ..model.source import WeightSource
from .shard import FFNShard, load_ffn_shard

log = logging.getLogger(__name__)
HEADROOM = 256 << 20  # bytes of /dev/shm left free for the channel and Ray
_open_fds: list[int] = []  # the shared files of this process (open for its lifetime)


@dataclass(frozen=True)
class SharedShardSpec:
    """Where each layer's rows are in the file (element offsets); the small parts travel inline."""

    path: str
    dtype: str  # torch dtype name of the weights
    numel: int
    d: int  # elements of a row (quantized rows: bytes)
    # per layer: (ids [n], off_up, off_gate or -1, off_down, up_bias [n] float32 or None)
    layers: tuple[tuple[np.ndarray, int, int, int, np.ndarray | None], ...]
    qtype: str | None = None  # 'q8_0' | 'q4_0': the rows are blocks (dtype uint8)


def _views(buf: torch.Tensor, spec: SharedShardSpec) -> list[FFNShard]:
    out = []
    for ids, o_up, o_gate, o_down, bias in spec.layers:
        n = len(ids)

        def at(off: int) -> torch.Tensor:
            return buf[off: off + n * spec.d].view(n, spec.d)

        out.append(FFNShard(np.asarray(ids), at(o_up), at(o_gate) if o_gate >= 0 else None, at(o_down),
                            None if bias is None else torch.from_numpy(np.array(bias)), spec.qtype))
    return out


def share(n_rows: list[int], gated: bool, d: int, dtype: torch.dtype, load: Callable[[int], FFNShard],
          defer: Callable[[int], tuple[np.ndarray, np.ndarray | None]] | None = None,
          qtype: str | None = None) -> tuple[list[FFNShard], SharedShardSpec] | None:
    """Load layer l's shard with ``load(l)`` (n_rows[l] rows) straight into a new shared file,
    one layer at a time (peak memory: the file plus one layer); the shards over it and its spec,
    or None without loading anything (nothing to share, no room in /dev/shm).
    defer: ``defer(l)`` -> (ids, up_bias or None) of layer l, and the rows are left for `fill`
    (by another process); ``load`` is then not called. qtype: the rows are blocks of that type
    (d their bytes, dtype uint8)."""
    per_row = d * (3 if gated else 2)
    numel = sum(n_rows) * per_row
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return None
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    if free < nbytes + HEADROOM:
        log.warning("CPU shard not shared: %s has %.1f GiB free, the shard needs %.1f GiB; the primary "
                    "will need its own copy for dense prefill", SHM_DIR, free / 2**30, nbytes / 2**30)
        return None
    path = SHM_DIR / f"powerinfer-shard-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # every page reserved now: no SIGBUS on a later write
    except OSError as e:
        os.close(fd)
        path.unlink(missing_ok=True)
        log.warning("CPU shard not shared: reserving %.1f GiB in %s failed (%s)", nbytes / 2**30, SHM_DIR, e)
        return None
    # The name goes at once; the open fd keeps the file, and the primary opens it as
    # /proc/<pid>/fd/<fd>: nothing is left in /dev/shm whichever process dies first.
    path.unlink()
    _open_fds.append(fd)
    proc_path = f"/proc/{os.getpid()}/fd/{fd}"
    try:
        buf = torch.from_file(proc_path, shared=True, size=numel, dtype=dtype)
        layers, off = [], 0
        for l, n in enumerate(n_rows):  # layer l: [up | gate | down] of n rows each
            offs = (off, off + n * d if gated else -1, off + (2 if gated else 1) * n * d)
            off += n * per_row
            if defer is not None:  # the layout only
                ids, bias = defer(l)
                if len(ids) != n:
                    raise ValueError(f"layer {l}: {len(ids)} ids, expected {n}")
            else:
                sh = load(l)
                for o, t in zip(offs, (sh.up, sh.gate, sh.down_t)):
                    if (t is None) != (o < 0) or (t is not None and (tuple(t.shape) != (n, d) or t.dtype != dtype)):
                        got = "no rows" if t is None else f"rows {tuple(t.shape)} {t.dtype}"
                        raise ValueError(f"layer {l}: shard {got}, expected ({n}, {d}) {dtype} "
                                         f"({'gated' if gated else 'no gate'})")
                    if t is not None:  # pwrite, as `fill`: not through the fresh mapping
                        _pwrite_all(fd, t.contiguous(), o * buf.element_size())
                ids, bias = sh.ids, None if sh.up_bias is None else sh.up_bias.float().numpy()
                del sh
            layers.append((np.asarray(ids), *offs, bias))
    except BaseException:
        _open_fds.remove(fd)
        os.close(fd)
        raise
    spec = SharedShardSpec(proc_path, str(dtype).removeprefix("torch."), numel, d, tuple(layers), qtype)
    return _views(buf, spec), spec


def attach(spec: SharedShardSpec) -> tuple[list[FFNShard], torch.Tensor] | None:
    """Map the shared file: the shards over it and the flat buffer (to pin it); None if it cannot
    be opened (its process is gone, or /proc/<pid>/fd is not readable here)."""
    try:
        buf = torch.from_file(spec.path, shared=True, size=spec.numel, dtype=getattr(torch, spec.dtype))
    except (OSError, RuntimeError) as e:
        log.warning("the CPU executor's shared shard (%s) could not be mapped: %s", spec.path, e)
        return None
    return _views(buf, spec), buf


def fill(spec: SharedShardSpec, src: WeightSource, device: torch.device) -> None:
    """Write every layer's rows into a file laid out by ``share(..., defer=...)``, loading them from
    ``src`` on ``device``. The rows go in with pwrite through a file descriptor of our own (from a
    staging buffer, pinned on CUDA, when they were loaded off the host), not through a mapping:
    copying into freshly mapped tmpfs pages takes a page fault per 4 KB, several times slower.
    RuntimeError if the file cannot be opened."""
    try:
        fd = os.open(spec.path, os.O_WRONLY)
    except OSError as e:
        raise RuntimeError(f"the CPU executor's shared shard ({spec.path}) could not be opened to fill it: {e}") from e
    dtype = getattr(torch, spec.dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    stage = None  # rows loaded on a GPU come to the host through one pinned buffer; CPU rows go as they are
    if device.type != "cpu":
        most = max((len(ids) for ids, *_ in spec.layers), default=0) * spec.d
        stage = torch.empty(most, dtype=dtype, pin_memory=device.type == "cuda")
    try:
        for l, (ids, off_up, off_gate, off_down, _) in enumerate(spec.layers):
            if not len(ids):
                continue
            sh = load_ffn_shard(src, l, ids, dtype, device)
            for off, rows in ((off_up, sh.up), (off_gate, sh.gate), (off_down, sh.down_t)):
                if rows is not None:
                    host = rows.contiguous() if stage is None else stage[: rows.numel()].view_as(rows).copy_(rows)
                    _pwrite_all(fd, host, off * esize)
            del sh
    finally:
        os.close(fd)


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    """All of a contiguous CPU tensor's bytes to fd at offset (pwrite may write less per call)."""
    view = memoryview(t.view(-1).view(torch.uint8).numpy())
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def prefault(shards: list[FFNShard]) -> None:
    """Read every page of the shards once, so this process's first decode steps do not take the
    page faults of a mapping another process wrote."""
    for sh in shards:
        for t in (sh.up, sh.gate, sh.down_t):
            if t is not None and t.numel():
                t.view(-1)[:: max(1, 4096 // t.element_size())].sum()  # one element per page


def release(spec: SharedShardSpec | None) -> None:
    """Close this process's handle on a file it shared (``share``): the pages go when the last
    mapping does."""
    if spec is None:
        return
    fd = int(spec.path.rsplit("/", 1)[1])
    if fd in _open_fds and spec.path.startswith(f"/proc/{os.getpid()}/fd/"):
        _open_fds.remove(fd)
        os.close(fd)
