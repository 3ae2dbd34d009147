#!/usr/bin/env bash
# A/B of the 13B hybrid against an older commit, both in one GPU-host call.
#
#   bash bench/ab_baseline.sh prepare REV     # here: .baseline/flat = REV's package, flattened
#   source .gpu-host/activate.sh && CUR=$(git rev-parse --short HEAD) \
#       bash bench/ab_baseline.sh run base cur cur base      # there, with carry [".gpu-host", ".baseline"]
#
# "base" runs REV from .baseline/flat (actors/, kernels/, placement/ moved inside powerinfer_ray/)
# on PYTHONPATH with the project uninstalled, so no import reaches the working tree; "cur" runs the
# editable install. JSON and logs go to $OUT as ab-<n>-<variant>.*. Env: M (model), BUDGET (GiB),
# LIMIT (seconds per run).
set -u
root=$(pwd)
case ${1:?usage: ab_baseline.sh prepare REV | run ORDER...} in
prepare)
    rev=${2:?the baseline commit}
    rm -rf .baseline && mkdir -p .baseline/flat
    git archive "$rev" | tar -x -C .baseline
    cp -r .baseline/powerinfer_ray .baseline/bench .baseline/flat/
    for pkg in actors kernels placement; do cp -r ".baseline/$pkg" ".baseline/flat/powerinfer_ray/$pkg"; done
    # what the bench does not need (results, the embedded model and corpus): the call carries 64 MiB
    rm -rf .baseline/flat/bench/results .baseline/flat/powerinfer_ray/data/*.{gguf,parquet,gz}
    find .baseline -mindepth 1 -maxdepth 1 ! -name flat -exec rm -rf {} +
    git rev-parse --short "$rev" > .baseline/REV
    grep -qx "/.baseline/" .git/info/exclude || echo "/.baseline/" >> .git/info/exclude
    du -sh .baseline
    ;;
run)
    shift
    : "${OUT:?OUT must be set (the device tool sets it)}" "${CUR:?CUR: the commit being measured}"
    base_rev=$(cat .baseline/REV)
    M=${M:-"planted:llama2-13b?dtype=f16"}
    n=0
    for v in "$@"; do
        n=$((n + 1))
        if [ "$v" = base ]; then
            pip uninstall -y -q powerinfer-ray > /dev/null 2>&1
            dir=$root/.baseline/flat; commit=$base_rev; pp=$dir${PYTHONPATH:+:$PYTHONPATH}
        else
            (cd "$root" && pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1)
            dir=$root; commit=$CUR; pp=${PYTHONPATH:-}
        fi
        (cd "$dir" && PYTHONPATH=$pp POWERINFER_COMMIT=$commit timeout -s INT "${LIMIT:-110}" \
            python -m powerinfer_ray.cli bench suite --out-dir "$OUT" --name "ab-$n-$v" -m "$M" \
            --vram-budget "${BUDGET:-16}" --modes hybrid --shapes 64x128 --batch 1 -t 14 > "$OUT/ab-$n-$v.log" 2>&1)
        echo "[$n $v] $(grep -E 'decode' "$OUT/ab-$n-$v.log" | cut -c1-420) $(grep -E 'Error' "$OUT/ab-$n-$v.log" | tail -1 | cut -c1-200)"
    done
    cd "$root" && pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1
    ;;
*)
    echo "usage: ab_baseline.sh prepare REV | run ORDER..." >&2
    exit 2
    ;;
esac
