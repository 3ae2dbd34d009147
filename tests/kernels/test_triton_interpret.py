"""The Triton kernels on the CPU through Triton's interpreter: runs interpret_cases.py in a
subprocess with TRITON_INTERPRET=1. Skipped without triton, and where CUDA is present
(tests/gpu runs the compiled kernels there)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: tests/gpu runs the real kernels")
def test_triton_kernels_under_the_interpreter():
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "interpret_cases.py")],
                          cwd=here, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
