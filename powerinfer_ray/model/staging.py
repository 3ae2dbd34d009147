"""Rows of a model file's memory map to a device: ``copy_rows``.

To a CUDA device inside ``pinned_staging(device)`` the rows go through two pinned host buffers:
the host copies (or gathers) a chunk of rows into one while the other's copy to the GPU runs, so
the transfer runs at the link's pinned speed with the gather hidden behind it. Outside it, a copy
from the mapping's pageable pages is synchronous and several times slower (bench/load_bench.py).
The primary executor loads its weights inside ``pinned_staging``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

STAGE_BYTES = 32 << 20  # each of the two pinned buffers


class _Stager:
    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device, self.cuda = device, device.type == "cuda"  # elsewhere: unpinned, no events (a test's)
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.i = 0

    def copy(self, view: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        n = view.shape[0] if ids is None else len(ids)
        row = view[0].numel() * view.element_size() if view.shape[0] else 1
        dst = torch.empty((n, *view.shape[1:]), dtype=view.dtype, device=self.device)
        per = len(self.bufs[0]) // row
        for a in range(0, n, per):
            b, i = min(n, a + per), self.i
            if self.done[i] is not None:
                self.done[i].synchronize()  # this buffer's last copy to the GPU has finished
            host = self.bufs[i][:(b - a) * row].view(view.dtype).view(b - a, *view.shape[1:])
            if ids is None:
                host.copy_(view[a:b])
            else:
                torch.index_select(view, 0, ids[a:b], out=host)
            dst[a:b].copy_(host, non_blocking=self.cuda)
            if self.cuda:
                self.done[i] = torch.cuda.Event()
                self.done[i].record()
            self.i ^= 1
        return dst

    def close(self) -> None:
        for e in self.done:
            if e is not None:
                e.synchronize()


_active: _Stager | None = None


def _indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextmanager
def pinned_staging(device: torch.device | str) -> Iterator[None]:
    """Within it, ``copy_rows`` to ``device`` (a CUDA device; elsewhere this does nothing) goes
    through pinned buffers (see the module docstring). Not for concurrent use from several threads."""
    global _active
    device = _indexed(device)
    if device.type != "cuda" or _active is not None:
        yield
        return
    _active = _Stager(device, STAGE_BYTES)
    try:
        yield
    finally:
        stager, _active = _active, None
        stager.close()


def copy_rows(view: torch.Tensor, ids: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """Rows ``ids`` of ``view`` (all when None; a row-major view of the mapping, rows first) as a
    tensor of its dtype on ``device``, a copy."""
    device = _indexed(device)
    if device.type == "cpu":
        return view.clone() if ids is None else view.index_select(0, ids)
    staged = _active is not None and _active.device == device and view.dim() > 0 and view.is_contiguous()
    if staged and view[0].numel() * view.element_size() <= STAGE_BYTES:  # a row fits a buffer
        return _active.copy(view, ids)
    return (view if ids is None else view.index_select(0, ids)).to(device)
