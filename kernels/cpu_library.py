"""The compiled CPU kernels (csrc/sparse_ffn.cpp and its headers): build at first use, load, bind.

The C++ source is compiled once per machine with the system compiler (`g++ -O3 -march=native
-pthread`: the vector code follows the CPU's instruction set, see csrc/simd.h and csrc/quant.h;
the parallel regions run on the library's own worker threads, csrc/pool.h) into a cache directory and loaded with ctypes; no torch headers, no build step at install time.
The source compiles as six units side by side (UNITS: the API, and the kernels of each weight
type), linked into one library: a host's first start waits for the slowest unit, not the sum.
When no compiler works, `library()` returns None, a warning says so once, and callers fall back
to the torch path.

Cache directory: kernels/ under `cache_root()` ($POWERINFER_RAY_CACHE, else ~/.cache/powerinfer_ray).
The file name hashes the sources, the flags, the compiler and the CPU's feature flags, so a home
directory shared between different CPUs never loads a foreign build.

$POWERINFER_RAY_CPU_CFLAGS adds compiler flags to every build of the process and of the processes
it starts, e.g. `-mno-avx512f` (the vector code of an AVX2 CPU) or `-mno-avx512f -mno-fma` (the
portable code of a CPU without FMA): `scripts/test.sh --portable` runs the suite so. These two
variables and serve/config.py's are the package's environment reads.

A process uses one build: the default one, or a variant that `select_build(cflags)` loads before
the first kernel call (extra compiler flags, e.g. -mno-avx512f for the tests and benchmarks of
each vector path).
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
from collections.abc import Sequence
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
MAIN = CSRC / "sparse_ffn.cpp"
FLAGS = ("-O3", "-march=native", "-pthread", "-fPIC", "-std=c++17")
FALLBACK_FLAGS = ("-O3", "-pthread", "-fPIC", "-std=c++17")  # compilers without -march=native
UNITS = (-1, 0, 1, 2, 3, 4)  # PI_W of each translation unit (csrc/sparse_ffn.cpp): the API, each weight type
COMPILERS = ("g++", "c++", "clang++")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_cflags: tuple[str, ...] = ()
_lib_failed = False


def cache_root() -> Path:
    """The project's cache folder: compiled kernels, and solved splits of files in folders we may
    not write (``runtime.config.split_cache_path``)."""
    return Path(os.environ.get("POWERINFER_RAY_CACHE") or Path.home() / ".cache" / "powerinfer_ray")


def cache_dir() -> Path:
    return cache_root() / "kernels"


def env_cflags() -> tuple[str, ...]:
    """Compiler flags every build adds ($POWERINFER_RAY_CPU_CFLAGS, split on spaces)."""
    return tuple(os.environ.get("POWERINFER_RAY_CPU_CFLAGS", "").split())


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return next((c for c in COMPILERS if shutil.which(c)), None)


def _sources() -> bytes:
    return b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))


def build(cflags: Sequence[str] = (), cxx: str | None = None) -> Path:
    """The shared library of the kernels built with FLAGS, `env_cflags()` and `cflags` (compiled
    unless cached); RuntimeError with the compiler's message if it cannot be built."""
    cflags = env_cflags() + tuple(cflags)
    cxx = cxx or _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found (looked for {', '.join(COMPILERS)} on PATH)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256(_sources() + " ".join(FLAGS + tuple(cflags)).encode() + version.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    out = cache_dir() / f"sparse_ffn-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in (FLAGS, FALLBACK_FLAGS):
        # Build in a temporary folder and rename the library: concurrent processes never load a partial .so.
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            objs = [os.path.join(tmp, f"unit{k + 1}.o") for k in UNITS]
            procs = [subprocess.Popen([cxx, *flags, *cflags, f"-DPI_W={k}", "-c", str(MAIN), "-o", o],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for k, o in zip(UNITS, objs)]
            errs = [p.communicate()[1] for p in procs]
            failed = [err for p, err in zip(procs, errs) if p.returncode != 0]
            if not failed:
                so = os.path.join(tmp, "lib.so")
                proc = subprocess.run([cxx, *flags, *cflags, "-shared", *objs, "-o", so], capture_output=True,
                                      text=True)
                if proc.returncode == 0:
                    os.replace(so, out)
                    return out
                failed = [proc.stderr]
        errors.append(failed[0][-2000:])
    raise RuntimeError(f"{cxx} could not build {MAIN.name}:\n" + "\n".join(errors))


def build_in_background() -> threading.Thread:
    """Start ``library()`` (the build on a host's first use, then the load) in a daemon thread,
    so that it runs while the caller does other start-up work; a later ``library()`` call waits
    for it."""
    th = threading.Thread(target=library, name="kernel-build", daemon=True)
    th.start()
    return th


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.pi_sparse_ffn.restype = i64
    lib.pi_sparse_ffn.argtypes = [p, i64, i64, p, p, p, i32, i64, i64, i64, i64, p, i32,
                                  p, i32, i64, p, i32, i64, i32, p, i32, p, i32, i32, f32, i32]
    lib.pi_sparse_ffn_bitmask_argv.restype = i64
    lib.pi_sparse_ffn_bitmask_argv.argtypes = [p]
    lib.pi_serve.restype = i64
    lib.pi_serve.argtypes = [p, i64, p, p, i64, p, p]
    lib.pi_scratch_bytes.restype = i64
    lib.pi_scratch_bytes.argtypes = [i64, i64, i64, i32, i32, i32, i32, i32]
    lib.pi_read_sum.restype = ctypes.c_double
    lib.pi_read_sum.argtypes = [p, i64, i32]
    lib.pi_linear.restype = i64
    lib.pi_linear.argtypes = [p, i64, i64, p, i32, i64, i64, p, i32]
    lib.pi_quantize_q8_0.restype = i64
    lib.pi_quantize_q8_0.argtypes = [p, i64, p]
    lib.pi_simd_width.restype = i32
    lib.pi_quant_isa.restype = i32
    lib.pi_pool_config.restype = i32
    lib.pi_pool_config.argtypes = [i64, p, i32]
    return lib


def library() -> ctypes.CDLL | None:
    """The process's kernel library, compiled at first use; None (with one warning) if impossible."""
    global _lib, _lib_failed
    if _lib is not None or _lib_failed:
        return _lib
    with _lock:
        if _lib is None and not _lib_failed:
            try:
                _lib = _bind(ctypes.CDLL(str(build())))
            except (RuntimeError, OSError) as e:
                _lib_failed = True
                warnings.warn(f"powerinfer_ray.kernels: the compiled CPU kernels are unavailable, "
                              f"using the slower torch path instead ({e})", RuntimeWarning, stacklevel=3)
    return _lib


def select_build(cflags: Sequence[str]) -> ctypes.CDLL:
    """Load the build with extra compiler flags `cflags` as this process's library (before its first
    kernel call; the same flags again are a no-op). ValueError if another build is loaded."""
    global _lib, _lib_cflags
    cflags = tuple(cflags)
    with _lock:
        if _lib is not None:
            if _lib_cflags != cflags:
                raise ValueError(f"select_build: cflags {cflags} requested, but this process already loaded "
                                 f"the build with {_lib_cflags}; select a build before the first kernel call")
            return _lib
        _lib, _lib_cflags = _bind(ctypes.CDLL(str(build(cflags)))), cflags
        return _lib


def available() -> bool:
    return library() is not None


def configure_threads(spin_us: int, cpus: Sequence[int] = ()) -> int:
    """The kernels' worker threads (csrc/pool.h): after a call they spin for ``spin_us`` before
    sleeping (a caller whose calls come closer than that finds them running); ``cpus`` pins the
    calling thread to cpus[0] and worker i to cpus[i] (empty: no pinning). Call it from the thread
    that calls the kernels. Returns the workers started so far (0 without a build)."""
    lib = library()
    if lib is None:
        return 0
    if not isinstance(spin_us, int) or spin_us < 0:
        raise ValueError(f"configure_threads: spin_us is {spin_us!r}, expected an int >= 0")
    ids = (ctypes.c_int32 * len(cpus))(*cpus)
    return int(lib.pi_pool_config(spin_us, ids if len(cpus) else None, len(cpus)))


def simd_width() -> int:
    """fp32 lanes of the build's vector code (16 AVX-512, 8 AVX2 or portable), 0 without a build."""
    lib = library()
    return int(lib.pi_simd_width()) if lib is not None else 0
