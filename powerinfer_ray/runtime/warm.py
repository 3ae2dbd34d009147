"""Warming the pages of a memory-mapped model that the CPU executor computes on in place.

Loading maps the file and reads nothing. The first decode steps would then take the page
faults of every row they touch: minor ones (page-table entries) for a file on tmpfs or in the
page cache, reads from the disk for a cold cache. ``Warmer`` walks the CPU executor's rows in a
background thread, layer by layer in shard order (hottest rows first where the plan orders
them so), asking the kernel to map them (madvise MADV_POPULATE_READ; on kernels without it, a
read of one byte per page), with a progress bar when the pages are not in memory yet.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
import time

import numpy as np

from .shard import FFNShard

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux >= 5.14
CHUNK_ROWS = 1024  # rows of shard order warmed per step (sorted into runs of adjacent rows)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _page_span(addr: int, nbytes: int) -> tuple[int, int]:
    start = addr - addr % PAGE
    return start, (addr + nbytes - start + PAGE - 1) // PAGE * PAGE


def resident_share(addr: int, nbytes: int) -> float:
    """The share of the pages of [addr, addr + nbytes) in memory (mincore); 1.0 if unknown."""
    start, length = _page_span(addr, nbytes)
    vec = np.zeros(length // PAGE, np.uint8)
    if _libc.mincore(start, length, vec.ctypes.data) != 0:
        return 1.0
    return float((vec & 1).mean()) if len(vec) else 1.0


class _Populate:
    """Map pages of a range into this process: madvise(MADV_POPULATE_READ), else a read per page."""

    def __init__(self) -> None:
        self.madvise = True

    def __call__(self, addr: int, nbytes: int) -> None:
        start, length = _page_span(addr, nbytes)
        if self.madvise and _libc.madvise(start, length, MADV_POPULATE_READ) == 0:
            return
        if self.madvise:
            log.info("madvise(MADV_POPULATE_READ) unavailable (errno %d): warming by reading a byte per page",
                     ctypes.get_errno())
            self.madvise = False
        pages = np.frombuffer((ctypes.c_uint8 * length).from_address(start), np.uint8)
        int(pages[::PAGE].sum())


def _runs(rows: np.ndarray, gap: int = 2) -> list[tuple[int, int]]:
    """Sorted rows as [a, b) runs, joining runs fewer than ``gap`` rows apart."""
    if not len(rows):
        return []
    r = np.sort(rows)
    breaks = np.flatnonzero(np.diff(r) > gap)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(r) - 1]])
    return [(int(r[a]), int(r[b]) + 1) for a, b in zip(starts, ends)]


def _row_ranges(sh: FFNShard, rows: np.ndarray) -> list[tuple[int, int]]:
    """(address, bytes) of rows ``rows`` of an in-place shard's matrices, a chunk at a time."""
    out = []
    mats = [t for t in (sh.up, sh.gate, sh.down_t) if t is not None]
    for c in range(0, len(rows), CHUNK_ROWS):
        for a, b in _runs(rows[c: c + CHUNK_ROWS]):
            for t in mats:
                rb = t.stride(0) * t.element_size()
                out.append((t.data_ptr() + a * rb, (b - a) * rb))
    return out


def warm_ranges(shards: list[FFNShard]) -> list[tuple[int, int]]:
    """(address, bytes) of the in-place shards' rows in the order they are warmed."""
    return [r for sh in shards if sh.rows is not None and sh.n for r in _row_ranges(sh, sh.rows.numpy())]


def warm_rows(sh: FFNShard, rows: np.ndarray) -> None:
    """Map rows ``rows`` (ids of the file's matrices) of an in-place shard now: rows that
    re-placement brought to the CPU executor, so its next steps take no page faults on them."""
    populate = _Populate()
    for addr, n in _row_ranges(sh, np.asarray(rows, np.int64)):
        populate(addr, n)


class Warmer:
    """Warms the rows of in-place shards in a daemon thread (``start``); ``state()`` says how far."""

    def __init__(self, shards: list[FFNShard], progress: bool | None = None) -> None:
        self.ranges = warm_ranges(shards)
        self.total = sum(n for _, n in self.ranges)
        self.done_bytes, self.seconds, self.finished = 0, 0.0, not self.ranges
        self._stop = threading.Event()
        self._progress = progress
        self.thread: threading.Thread | None = None

    def start(self) -> "Warmer":
        if self.ranges:
            self.thread = threading.Thread(target=self._run, name="warm-pages", daemon=True)
            self.thread.start()
        return self

    def _cold(self) -> bool:
        """Whether a sample of the ranges is mostly not in memory (a cold page cache)."""
        sample = self.ranges[:: max(1, len(self.ranges) // 64)]
        return np.mean([resident_share(a, n) for a, n in sample]) < 0.9

    def _run(self) -> None:
        t0 = time.perf_counter()
        bar = None
        if self._progress or (self._progress is None and self._cold()):
            from tqdm import tqdm

            bar = tqdm(total=self.total, desc="warming the CPU rows", unit="B", unit_scale=True, file=sys.stderr)
        populate = _Populate()
        try:
            for addr, n in self.ranges:
                if self._stop.is_set():
                    break
                populate(addr, n)
                self.done_bytes += n
                if bar is not None:
                    bar.update(n)
        except Exception:  # noqa: BLE001  (warming is an optimisation: say why it stopped)
            log.exception("warming the CPU rows stopped")
        finally:
            if bar is not None:
                bar.close()
            self.seconds, self.finished = time.perf_counter() - t0, True

    def state(self) -> dict:
        return {"bytes": self.done_bytes, "total": self.total, "s": round(self.seconds, 2), "done": self.finished}

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
