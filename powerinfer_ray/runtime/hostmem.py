"""Host memory: what this host and this process hold, and whether an engine's executors fit.

The model file is memory-mapped. Where the CPU executor computes on its rows in place
(``shard.in_place_ffn_shard``) they cost the file's pages and nothing more: on tmpfs (/dev/shm)
the file is in memory already, on a disk its CPU rows must stay in the page cache. Sources
without a file (planted models) copy the CPU's rows into shared memory. ``HostNeed`` adds up
what an engine needs beyond what the host holds now, and ``check_fits`` refuses a placement
that cannot fit before anything is loaded, naming the sizes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..model.costs import embedding_bytes
from ..model.source import WeightSource, file_mapping
from .channel import SHM_DIR
from .plan import Plan
from .shard import attn_views, in_place_ffn_shard
from .weights import DTYPES

GIB = 1 << 30
# private memory of an executor process besides its tensors (Python, torch, the kernel library,
# CUDA's host side): what a started executor of the tiny model holds, rounded up
PROCESS_BYTES = 1 << 30


@dataclass(frozen=True)
class HostMemory:
    total: int  # MemTotal
    available: int  # MemAvailable: what can be had without swapping (page cache of disk files included)
    shm_used: int  # bytes in /dev/shm (files and their unlinked-but-open peers)
    shm_free: int


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def host_memory() -> HostMemory:
    m = _meminfo()
    st = os.statvfs(SHM_DIR)
    return HostMemory(m["MemTotal"], m.get("MemAvailable", m["MemFree"]),
                      (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_bavail * st.f_frsize)


def process_memory() -> dict[str, int]:
    """This process's resident memory in bytes: peak (VmHWM) and now (VmRSS), split into private
    (anon), mapped files and shared memory (tmpfs pages, /dev/shm files included)."""
    keys = {"VmHWM": "rss_peak_bytes", "VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes",
            "RssFile": "rss_file_bytes", "RssShmem": "rss_shmem_bytes"}
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in keys:
                out[keys[key]] = int(rest.split()[0]) * 1024
    return out


def on_tmpfs(path: str | Path) -> bool:
    """Whether ``path`` lies on a tmpfs (its pages are memory, not a cache of a disk)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, parts[2]
    return fstype == "tmpfs"


@dataclass(frozen=True)
class HostNeed:
    """What an engine's executors need of host memory beyond what the host holds now."""

    cpu_rows: int  # bytes of the CPU executor's FFN rows
    rows_copied: bool  # copied (a source without a file, or a layout that cannot be read in place)
    rows_cached: bool  # in place from a file on disk: its CPU rows must stay in the page cache
    cpu_attention: int  # the CPU executor's attention weights where copied, and its KV cache
    processes: int  # executor processes
    embedding: int = 0  # the primary's token embedding in page-locked memory (Plan.embd_on_host)

    @property
    def total(self) -> int:
        rows = self.cpu_rows if self.rows_copied or self.rows_cached else 0
        return rows + self.cpu_attention + self.embedding + self.processes * PROCESS_BYTES

    def describe(self) -> str:
        rows = (f"{self.cpu_rows / GIB:.1f} GiB of FFN rows "
                + ("copied" if self.rows_copied else "kept in the page cache" if self.rows_cached
                   else "in place in the file on tmpfs (already in memory: 0)"))
        return (f"{rows}, {self.cpu_attention / GIB:.1f} GiB of CPU attention weights and KV cache, "
                f"{self.embedding / GIB:.1f} GiB of token embedding, "
                f"{self.processes} executor process(es) x {PROCESS_BYTES / GIB:.1f} GiB")


def cpu_attention_bytes(src: WeightSource, plan: Plan, slots: int, n_ctx: int) -> int:
    """The CPU executor's attention: q/k/v rows and o columns of its KV-head groups where they
    are copied (not read in place: ``shard.attn_views``), and their KV cache (fp32, ``slots`` + 1
    sequences)."""
    cfg = src.config
    hd, g, dtype = cfg.head_dim, cfg.n_gqa, DTYPES[cfg.float_dtype]
    per_group = int((2 * g + 2) * hd * cfg.n_embd * cfg.dtype_bytes)  # q and o of its g heads, k and v
    cache = 2 * (slots + 1) * n_ctx * hd * 4
    total = 0
    for l, lp in enumerate(plan.layers):
        if len(lp.cpu_groups):
            copied = attn_views(src, l, lp.cpu_groups, dtype) is None
            total += len(lp.cpu_groups) * ((per_group if copied else 0) + cache)
    return total


def check_fits(need: HostNeed, limit: int | None = None, what: str = "the model") -> None:
    """ValueError naming the sizes when ``need`` exceeds ``limit`` (default: the host's
    available memory)."""
    host = host_memory()
    avail = host.available if limit is None else int(limit)
    if need.total <= avail:
        return
    src = "available" if limit is None else "allowed (host memory limit)"
    raise ValueError(f"{what} does not fit this host's memory with this placement: the executors need "
                     f"{need.total / GIB:.1f} GiB ({need.describe()}), {avail / GIB:.1f} GiB are {src} "
                     f"(host total {host.total / GIB:.1f} GiB). Give the GPU a larger share (--vram-budget), "
                     "use a quantized model file, or free memory")


def host_need(src: WeightSource, plan: Plan, slots: int, n_ctx: int) -> HostNeed:
    """What the executors of ``plan`` over ``src`` need of host memory (see ``HostNeed``)."""
    cfg = src.config
    embedding = embedding_bytes(src) if plan.embd_on_host else 0
    if not plan.needs_cpu_executor:
        return HostNeed(0, False, False, 0, 1, embedding)
    rows = sum(len(lp.cpu_neurons) for lp in plan.layers) * cfg.neuron_bytes
    mapping = file_mapping(src)
    in_place = mapping is not None and all(
        in_place_ffn_shard(src, l, np.zeros(0, np.int64), DTYPES[cfg.float_dtype]) is not None
        for l, lp in enumerate(plan.layers) if len(lp.cpu_neurons))
    return HostNeed(rows, not in_place, in_place and not on_tmpfs(mapping.path),
                    cpu_attention_bytes(src, plan, slots, n_ctx), 2, embedding)
