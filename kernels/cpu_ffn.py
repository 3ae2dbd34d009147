"""The compiled CPU sparse-FFN kernel (csrc/sparse_ffn.cpp): build at first use, load, call.

The C++ source is compiled once per machine with the system compiler
(`g++ -O3 -march=native -fopenmp`) into a cache directory and loaded with ctypes; no torch
headers, no build step at install time. When no compiler works, `library()` returns None, a
warning says so once, and callers fall back to the torch path.

Cache directory: $POWERINFER_RAY_CACHE, else $XDG_CACHE_HOME/powerinfer_ray, else
~/.cache/powerinfer_ray; the file name hashes the source, the flags, the compiler and the CPU's
feature flags, so a home directory shared between different CPUs never loads a foreign build.

Dimension legend: T tokens, D n_embd, N shard rows, K active rows.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "sparse_ffn.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
FALLBACK_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]  # compilers without -march=native

_W_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ACT = {"relu": 0, "reglu": 1, "drelu": 2, "swiglu": 3}
_MAX_T = 64  # tokens per kernel call (the kernel's stack buffers); more are split into calls

_lock = threading.Lock()  # one build, and one call at a time per process (shared scratch)
_lib: ctypes.CDLL | None = None
_lib_failed = False
_scratch: torch.Tensor | None = None


def cache_dir() -> Path:
    root = os.environ.get("POWERINFER_RAY_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "powerinfer_ray" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    return None


def _build(cxx: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = cache_dir() / f"sparse_ffn-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in (FLAGS, FALLBACK_FLAGS):
        # Build into a temporary file and rename: concurrent processes never load a partial .so.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, out)
            return out
        os.unlink(tmp)
        errors.append(proc.stderr[-2000:])
    raise RuntimeError(f"{cxx} could not build {SOURCE.name}:\n" + "\n".join(errors))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pi_sparse_ffn.restype = i64
    lib.pi_sparse_ffn.argtypes = [p, i64, i64, p, p, p, i32, i64, i64, i64, i64, p, i32,
                                  p, i32, i64, p, i32, i64, i32, p, i32, p, i32]
    lib.pi_read_sum.restype = ctypes.c_double
    lib.pi_read_sum.argtypes = [p, i64, i32]
    lib.pi_simd_width.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, compiled at first use; None (with one warning) if impossible."""
    global _lib, _lib_failed
    if _lib is not None or _lib_failed:
        return _lib
    with _lock:
        if _lib is None and not _lib_failed:
            cxx = _compiler()
            try:
                if cxx is None:
                    raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")
                _lib = _bind(ctypes.CDLL(str(_build(cxx))))
            except (RuntimeError, OSError) as e:
                _lib_failed = True
                warnings.warn(f"powerinfer_ray.kernels: the compiled CPU sparse-FFN kernel is unavailable, "
                              f"using the slower torch path instead ({e})", RuntimeWarning, stacklevel=3)
    return _lib


def available() -> bool:
    return library() is not None


def simd_width() -> int:
    lib = library()
    return int(lib.pi_simd_width()) if lib is not None else 0


def _scratch_for(n: int) -> torch.Tensor:
    global _scratch
    if _scratch is None or _scratch.numel() < n:
        _scratch = torch.empty(n, dtype=torch.float32)
    return _scratch


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_ok(w: torch.Tensor, D: int) -> bool:
    return w.dim() == 2 and w.shape[1] == D and w.stride(1) == 1


def sparse_ffn_cpu(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor | None, down_t: torch.Tensor,
                   idx: torch.Tensor, mask: torch.Tensor | None, act: str, up_bias: torch.Tensor | None,
                   y: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """Run the compiled kernel; inputs already validated by `sparse_ffn` (CPU tensors).

    x [T, D] any float dtype; up, gate, down_t [N, D] rows with unit column stride, one of
    fp32 / fp16 / bf16; idx [K] int32 or int64; mask None, bool [T, K] or int32 bits [K];
    y [T, D] contiguous, x's dtype. Returns y.
    """
    lib = library()
    assert lib is not None, "sparse_ffn_cpu called without a compiled kernel"
    T, D = x.shape
    N, K = up.shape[0], idx.numel()
    wdt = _W_DT[up.dtype]
    assert all(w is None or (w.dtype == up.dtype and _rows_ok(w, D)) for w in (up, gate, down_t)), \
        f"weights must share dtype {up.dtype} and have unit column stride"
    idx = idx if idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous() else idx.contiguous().long()
    bias = None if up_bias is None else up_bias.contiguous()
    if bias is not None and bias.dtype not in _W_DT:
        bias = bias.float()
    mode, ld_mask = 0, 0
    if mask is not None:
        if mask.dtype == torch.bool:
            mask, mode = mask.contiguous(), 1
            ld_mask = mask.shape[1]
        else:
            mask, mode = mask.to(torch.int32).contiguous(), 2
    nthreads = int(threads or torch.get_num_threads())
    with _lock:
        for t0 in range(0, T, _MAX_T):
            t1 = min(T, t0 + _MAX_T)
            xs = x[t0:t1].to(torch.float32).contiguous()  # [Tc, D] fp32: x is read T x K times
            ys = y[t0:t1]
            ms = mask[t0:t1] if mode == 1 else mask
            if mode == 2 and t0:
                ms = torch.bitwise_right_shift(mask, t0)
            scratch = _scratch_for(nthreads * (t1 - t0) * D)
            rc = lib.pi_sparse_ffn(
                xs.data_ptr(), t1 - t0, D,
                up.data_ptr(), _ptr(gate), down_t.data_ptr(), wdt,
                up.stride(0), gate.stride(0) if gate is not None else 0, down_t.stride(0), N,
                _ptr(bias), _W_DT.get(bias.dtype, 0) if bias is not None else 0,
                idx.data_ptr(), int(idx.dtype == torch.int64), K,
                _ptr(ms), mode, ld_mask,
                _ACT[act], ys.data_ptr(), _W_DT[y.dtype], scratch.data_ptr(), nthreads)
            if rc != 0:
                if rc == -1000000000:
                    raise ValueError(f"sparse_ffn_cpu: bad arguments T={T}, D={D}, threads={nthreads}")
                k = -rc - 1
                raise IndexError(f"sparse_ffn: idx[{k}] = {int(idx[k])} is outside the shard's rows [0, {N})")
    return y


def read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, reps: int = 5) -> float:
    """Multi-threaded DRAM read rate in GB/s (median of reps) with the kernel's threads: the CPU
    ceiling the benchmark reports fractions of."""
    import time

    lib = library()
    nthreads = int(threads or torch.get_num_threads())
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        if lib is not None:
            lib.pi_read_sum(buf.data_ptr(), buf.numel(), nthreads)
        else:
            buf.sum()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return nbytes / times[len(times) // 2] / 1e9
