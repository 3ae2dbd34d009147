#!/usr/bin/env bash
# Quick start: run the test suite (GPU tests skip without CUDA). Extra arguments go to pytest.
set -e
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh test
# The repository root must not be on sys.path: its kernels/ (installed as powerinfer_ray.kernels)
# would shadow the PyPI package `kernels`, which transformers >= 5.25 imports. PYTHONSAFEPATH keeps
# `python -m` (here and in the tests' subprocesses) from prepending the working directory.
export PYTHONSAFEPATH=1
exec python -m pytest -q -ra "$@"
