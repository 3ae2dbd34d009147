"""Measure the host the placement is solved for: memory bandwidths and the per-layer sync.

Measured: host DRAM read GB/s with all threads (a torch sum over a buffer far larger than the
caches) always; with CUDA also the GPU's HBM copy GB/s (bytes read + written), pinned H2D bulk
GB/s, and a 10 KB pinned D2H + H2D round trip as the estimate of one CPU-GPU synchronisation
per layer. Without CUDA the GPU numbers keep their defaults (DESIGN.md section 2: 4190 GB/s HBM,
55 GB/s H2D, 45 us sync). GB = 1e9 bytes. Saved as ``placement.host.HostProfile``.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

DEFAULTS = {"hbm_gbs": 4190.0, "dram_gbs": 180.0, "pcie_h2d_gbs": 55.0, "sync_us": 45.0}
SYNC_BYTES = 10 * 1024  # one layer's hidden state plus the flags, as in DESIGN.md section 2


def _median_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] | None = None) -> float:
    fn()  # warm-up: page faults, allocator, first-touch
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_dram_gbs(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 5) -> float:
    """Host DRAM read bandwidth: a multi-threaded sum over an fp32 buffer of ``nbytes``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        t = _median_seconds(lambda: buf.sum(), repeats)
    finally:
        torch.set_num_threads(old)
    return buf.numel() * 4 / t / 1e9


def measure_hbm_gbs(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _median_seconds(lambda: dst.copy_(src), repeats, torch.cuda.synchronize)
    return 2 * nbytes / t / 1e9


def measure_h2d_gbs(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Bulk host-to-device copy from pinned memory."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t = _median_seconds(lambda: dst.copy_(src, non_blocking=True), repeats, torch.cuda.synchronize)
    return nbytes / t / 1e9


def measure_sync_us(nbytes: int = SYNC_BYTES, repeats: int = 200) -> float:
    """A small pinned D2H copy, then H2D back, waited for: the per-layer round trip."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def round_trip() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return _median_seconds(round_trip, repeats) * 1e6


def measure(quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """All measurements as HostProfile fields; ``quick`` uses small buffers (tests)."""
    threads = os.cpu_count() or 1
    size = (64 << 20) if quick else (1 << 30)
    out: dict[str, Any] = dict(DEFAULTS, cpu_threads=threads)
    out["dram_gbs"] = measure_dram_gbs(size, threads, repeats=3 if quick else 5)
    log(f"host DRAM read ({threads} threads): {out['dram_gbs']:.1f} GB/s")
    if torch.cuda.is_available():
        out["hbm_gbs"] = measure_hbm_gbs(size)
        out["pcie_h2d_gbs"] = measure_h2d_gbs(min(size, 256 << 20))
        out["sync_us"] = measure_sync_us(repeats=50 if quick else 200)
        log(f"GPU HBM copy: {out['hbm_gbs']:.0f} GB/s; pinned H2D: {out['pcie_h2d_gbs']:.1f} GB/s; "
            f"10 KB D2H+H2D round trip: {out['sync_us']:.1f} us")
    else:
        log("no CUDA device: HBM, H2D and sync keep DESIGN.md section 2's defaults "
            f"({DEFAULTS['hbm_gbs']:.0f} GB/s, {DEFAULTS['pcie_h2d_gbs']:.0f} GB/s, {DEFAULTS['sync_us']:.0f} us)")
    return out


def calibrate_host(out_path: str | Path, quick: bool = False, log: Callable[[str], None] = print) -> Any:
    """Measure this host and save its profile to ``out_path`` (JSON); returns the profile
    (a ``HostProfile`` when placement.host is importable, else the dict that was written)."""
    values = measure(quick, log)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from ..placement.host import HostProfile
    except ImportError:
        path.write_text(json.dumps(values, indent=1) + "\n")
        return values
    profile = HostProfile(**{k: (float(v) if k != "cpu_threads" else int(v)) for k, v in values.items()})
    profile.save(path)
    log(f"host profile written to {path}: {json.dumps(asdict(profile))}")
    return profile
