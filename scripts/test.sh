#!/usr/bin/env bash
# Quick start: run the test suite (GPU tests skip without CUDA). Extra arguments go to pytest.
#
# scripts/test.sh --portable [pytest args]: the suite once per condition below, as on x86-64 CPUs
# other than this one. How fp32 sums round depends on the CPU kernels' vector code (csrc/simd.h,
# csrc/quant.h: AVX-512 with FMA, AVX2 with FMA, or portable C++ without FMA; built with
# POWERINFER_RAY_CPU_CFLAGS), on the ISA of torch's own kernels (ATen, MKL, oneDNN: held to the
# same level) and on how many threads split a sum (OMP_NUM_THREADS: 1 and 4, even on 2 cores,
# tests/conftest.py). Three runs cross the three builds with the two thread counts, so each build
# and each count is run once (six runs would cover every pair, at twice the time); the plain
# command is the native build at the machine's thread count. A decision at a threshold (a
# neuron's activity, a predictor's mask, a greedy token) may go either way where its value lies
# within rounding: tests compare with those ties allowed (tests/ties.py,
# tests/quant_models.py match_rounding). A summary line per condition comes at the end; the exit
# status is 1 if any run failed. CI (.ci/run) runs the plain command.
set -e
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh test
# The repository root must not be on sys.path: its kernels/ (installed as powerinfer_ray.kernels)
# would shadow the PyPI package `kernels`, which transformers >= 5.25 imports. PYTHONSAFEPATH keeps
# `python -m` (here and in the tests' subprocesses) from prepending the working directory.
export PYTHONSAFEPATH=1
if [ "${1:-}" != "--portable" ]; then
    exec python -m pytest -q -ra "$@"
fi
shift
# name | kernel compiler flags | ATen ISA | MKL ISA | oneDNN ISA | torch threads
CONDITIONS=(
    "native-t1|||||1"
    "avx2-t4|-mno-avx512f|avx2|AVX2|AVX2|4"
    "nofma-t1|-mno-avx512f -mno-fma|default|SSE4_2|SSE41|1"
)
summary=()
status=0
for c in "${CONDITIONS[@]}"; do
    IFS='|' read -r name cflags aten mkl dnnl threads <<<"$c"
    # PASSIVE: idle OpenMP threads sleep instead of spinning (4 threads on 2 cores were 3x slower)
    env=(POWERINFER_RAY_CPU_CFLAGS="$cflags" OMP_NUM_THREADS="$threads" OMP_WAIT_POLICY=PASSIVE)
    [ -n "$aten" ] && env+=(ATEN_CPU_CAPABILITY="$aten" MKL_ENABLE_INSTRUCTIONS="$mkl" ONEDNN_MAX_CPU_ISA="$dnnl")
    echo "=== portable run $name: ${env[*]}"
    log=$(mktemp)
    set +e
    env "${env[@]}" python -m pytest -q -ra "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    summary+=("$name (${env[*]}): rc=$rc: $(grep -E '[0-9]+ (passed|failed|errors?)' "$log" | tail -1)")
    rm -f "$log"
    [ "$rc" -ne 0 ] && status=1
done
printf '%s\n' "=== portable summary" "${summary[@]}"
exit "$status"
