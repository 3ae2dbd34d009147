#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv and install the project into it.
# Usage: source scripts/setup-venv.sh EXTRAS     EXTRAS: "base" (none) or e.g. "test"
# (always pass it: a sourced script without arguments sees its caller's arguments)
# torch: on these machines 'torch==2.13.0' resolves to the local CPU build; override with
# TORCH_SPEC (e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").
set -e
extras=${1:?usage: source scripts/setup-venv.sh base|test}
[ "$extras" = base ] && extras=""
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
"$py" -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is required, found " + sys.version' 
if [ ! -x "$root/.venv/bin/python" ]; then
  echo "[setup] creating $root/.venv" >&2
  "$py" -m venv "$root/.venv"
fi
vpy="$root/.venv/bin/python"
stamp="$root/.venv/.installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] installing powerinfer-ray${extras:+[$extras]} (first run takes a few minutes)" >&2
  log="$root/.venv/install.log"
  "$vpy" -m pip install -q --upgrade pip >"$log" 2>&1 || true
  "$vpy" -c 'import torch' 2>/dev/null || "$vpy" -m pip install ${TORCH_SPEC:-torch==2.13.0} >>"$log" 2>&1 \
    || { tail -20 "$log" >&2; echo "[setup] installing torch failed: see $log" >&2; return 1 2>/dev/null || exit 1; }
  "$vpy" -m pip install -e "$root${extras:+[$extras]}" >>"$log" 2>&1 \
    || { tail -20 "$log" >&2; echo "[setup] installing the project failed: see $log" >&2; return 1 2>/dev/null || exit 1; }
  "$vpy" -c 'import powerinfer_ray, torch, ray, gguf, cvxpy' && touch "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
