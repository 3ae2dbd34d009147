#!/usr/bin/env bash
# Quick start: run the test suite (GPU tests skip without CUDA). Extra arguments go to pytest.
set -e
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh test
exec python -m pytest -q -ra "$@"
