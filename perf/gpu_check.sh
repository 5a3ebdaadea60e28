#!/usr/bin/env bash
# One-shot kernel check for a lent GPU machine (torch + triton, no internet, minutes of time):
#   1. the Triton kernel tests (multi-query decode included), compiled on CUDA in bf16 (no
#      interpreter), vs the float64 twins and per-sequence float64 attention;
#   2. the kernel benchmark on the two target cases with a config sweep (tuning data);
#   3. the full kernel benchmark with the default configs;
#   4. issue 18's quantized kernels: INT8 weight-only linear vs bf16 cuBLAS, decode attention
#      over int8 / fp8_e4m3 caches vs bf16 (perf/quant_kernels_bench.py --quick).
# Everything lands in OUTDIR (default perf/results/gpu_check). Each step has its own timeout;
# the worst case stays under ~9.5 minutes. Exit status: 0 only if tests pass and every timed
# Triton result matched SDPA.
#
#   bash perf/gpu_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-perf/results/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# The machine's own Python carries the CUDA torch; a CPU-only dev venv would not do.
PY=""
for cand in "${PYTHON:-}" python3 python .venv/bin/python; do
    [ -n "$cand" ] || continue
    command -v "$cand" > /dev/null 2>&1 || continue
    if "$cand" -c "import torch, triton; assert torch.cuda.is_available()" > /dev/null 2>&1; then
        PY="$cand"
        break
    fi
done
if [ -z "$PY" ]; then
    log "no Python with CUDA torch + triton found; nothing to check"
    exit 2
fi
{
    nvidia-smi 2>&1 || true
    "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); print(torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
log "python: $PY ($(tail -n 1 "$OUT/env.txt"))"

export PDSERVE_KERNEL_TEST_DEVICE=cuda
export PDSERVE_KERNEL_TEST_DTYPE=bfloat16
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# pytest is pure Python: if the machine lacks it, borrow the dev venv's copy when it travelled
# along (carry .venv/lib/python3.*/site-packages/{pytest,_pytest,pluggy,iniconfig,packaging,pygments}).
if ! "$PY" -c "import pytest" > /dev/null 2>&1; then
    for site in .venv/lib/python3*/site-packages; do
        [ -d "$site/_pytest" ] || continue
        shim="$(mktemp -d)"
        for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py; do
            [ -e "$site/$pkg" ] && ln -s "$PWD/$site/$pkg" "$shim/$pkg"
        done
        export PYTHONPATH="$PYTHONPATH:$shim"
        break
    done
fi

status=0
if "$PY" -c "import pytest" > /dev/null 2>&1; then
    log "kernel tests (cuda, bf16)..."
    timeout -k 5 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/kernels/test_triton_kernels.py tests/kernels/test_verify_attention.py \
        tests/kernels/test_kv_quant*.py tests/kernels/test_int8_group.py \
        --junitxml="$OUT/kernel_tests.xml" \
        > "$OUT/kernel_tests.txt" 2>&1
    rc=$?
    log "kernel tests rc=$rc: $(tail -n 1 "$OUT/kernel_tests.txt")"
    [ $rc -eq 0 ] || status=1
else
    log "pytest not importable: kernel tests skipped (the benchmark still checks against SDPA)"
    status=1
fi

log "benchmark, target cases, config sweep..."
timeout -k 5 120 "$PY" -m perf.kernels_bench --quick --sweep --json "$OUT/bench_sweep.json" \
    > "$OUT/bench_sweep.txt" 2>&1
rc=$?
log "sweep rc=$rc"
grep '^target' "$OUT/bench_sweep.txt" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || status=1

log "benchmark, all cases, default configs..."
timeout -k 5 120 "$PY" -m perf.kernels_bench --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
rc=$?
log "bench rc=$rc"
grep '^target' "$OUT/bench.txt" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || status=1

log "quantized kernels (issue 18)..."
timeout -k 5 90 "$PY" -m perf.quant_kernels_bench --quick --json "$OUT/quant_kernels.json" \
    > "$OUT/quant_kernels.txt" 2>&1
rc=$?
log "quant kernels rc=$rc"
tee -a "$OUT/summary.txt" < "$OUT/quant_kernels.txt"
[ $rc -eq 0 ] || status=1

log "done, status=$status; results in $OUT"
exit $status
