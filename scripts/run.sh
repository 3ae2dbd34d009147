#!/usr/bin/env bash
# Quick start: generate text with the embedded default model on the hybrid engine.
# Extra arguments go to `powerinfer-ray generate` (e.g. -p "Some prompt" -n 64 --temperature 0.8).
set -e
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh base
exec powerinfer-ray generate "$@"
