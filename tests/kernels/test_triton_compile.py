"""Every Triton kernel compiles for sm_90 (H100 / H200) here, without a GPU: compile_cases.py in
its own process, through the kernels' wrappers and default tiles (a kernel that no case reaches
fails the test). Catches what the interpreter accepts and the GPU compiler does not, before a GPU
host runs the code."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

MODULES = ("triton_attention", "triton_fused", "triton_linear", "triton_norm", "triton_predictor", "triton_qgemv", "triton_signal", "triton_split", "triton_stages")


def _kernels() -> set[str]:
    """The @triton.jit kernels of kernels/triton_*.py (names ending in _kernel)."""
    from triton.runtime.jit import JITFunction

    names = set()
    for m in MODULES:
        mod = importlib.import_module(f"powerinfer_ray.kernels.{m}")
        names |= {n for n, v in vars(mod).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    return names


def test_every_triton_kernel_compiles_for_sm90(tmp_path):
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(here / "compile_cases.py")], cwd=here, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    compiled = set(proc.stdout.split())
    assert compiled == _kernels(), f"compiled {sorted(compiled)}; kernels {sorted(_kernels())}"
    assert any(tmp_path.glob("cache/*/*.cubin")), "no cubin written: the compile stopped before ptxas"
