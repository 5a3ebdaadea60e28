#!/usr/bin/env bash
# One-shot kernel check for a lent GPU machine (torch + triton, no internet, minutes of time):
#   1. the Triton kernel tests (multi-query decode included), compiled on CUDA in bf16 (no
#      interpreter), vs the float64 twins and per-sequence float64 attention;
#   2. the engine's tensor-parallel code path at TP 1 on the GPU (issue 28, perf/tp_check.py):
#      LLMEngine with tensor_parallel_size=1 on cuda (the default, given explicitly), a short
#      greedy generate of the demo model, and its layout fingerprint's tensor_parallel_size = 1;
#   3. the kernel benchmark on the two target cases with a config sweep (tuning data);
#   4. the full kernel benchmark with the default configs;
#   5. issue 18's quantized kernels: INT8 weight-only linear vs bf16 cuBLAS, decode attention
#      over int8 / fp8_e4m3 caches vs bf16 (perf/quant_kernels_bench.py --quick);
#   6. which transport UCX picks for GPU memory between two processes of this host (issue 29):
#      ucx_perftest tag_bw, cuda -> cuda, with the endpoint settings of pdserve's KV path
#      (ucxx's peer-failure handling, UCX_MM_ERROR_HANDLING=y); cuda_ipc is the fast path, so
#      anything else is logged as a warning. Recorded, never failing the check.
#   7. the roofline of the engine's passes on this GPU (issue 34, perf/roofline_bench.py): a
#      random-weight Llama of Llama-3.2-1B's shape in bf16 and with INT8 weights, decode at batch
#      1/4/16/64 and prefills of 512-2048 tokens against the GPU's peaks measured (full) before
#      and after; roofline_gpu.json (+ .png when matplotlib is there) in OUTDIR.
# Everything lands in OUTDIR (default perf/results/gpu_check). Each step has its own timeout;
# the worst case stays under ~12 minutes (typical runs take ~3). Exit status: 0 only if tests
# pass, the TP-1 engine check and the roofline run pass and every timed Triton result matched
# SDPA.
#
#   bash perf/gpu_check.sh [OUTDIR]
#
# A lent machine has one GPU, so NCCL at TP 2 (a GPU per rank) is not run here. On a host with
# two or more GPUs (perf/README.md, "Tensor parallelism on GPUs"):
#   python -m perf.tp_check --device cuda --tensor-parallel-size 2 --dtype float32 --compare
#   pdserve up --device cuda --prefill-tensor-parallel-size 2 --decode-tensor-parallel-size 2 \
#       --model demo              # rank r of every worker on cuda:r (--device auto: round-robin)
#   pdserve doctor --nats-url URL   # URL: the "nats:" line of up; lists each rank's transports
#
# Python packages a bare torch machine may lack are borrowed from a dev venv that travelled
# along (.venv/lib/python3.*/site-packages) or from the folder $GPU_CHECK_SITE: pytest (pytest
# _pytest pluggy iniconfig packaging pygments) for step 1, llguidance (+ its .dist-info),
# msgpack and safetensors for step 2, tokenizers for step 7's model (abi3 builds, and msgpack
# falls back to pure Python: any Python 3 takes them).
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

# `pdserve` is the repository itself (pyproject maps the namespace onto its folders): without an
# install, a link named pdserve to it does the same.
if ! "$PY" -c "import pdserve.kernels" > /dev/null 2>&1; then
    shim="$(mktemp -d)"
    ln -s "$PWD" "$shim/pdserve"
    export PYTHONPATH="$shim:$PYTHONPATH"
fi

# borrow MODULE PACKAGE...: when "$PY" cannot import MODULE, link PACKAGE... (names in a
# site-packages folder, globs allowed) from the first folder that has them (see the header).
borrow() {
    local module="$1" shim site entry path
    shift
    "$PY" -c "import $module" > /dev/null 2>&1 && return 0
    for site in ${GPU_CHECK_SITE:-} .venv/lib/python3*/site-packages; do
        [ -e "$site/$1" ] || continue
        shim="$(mktemp -d)"
        for entry in "$@"; do
            for path in "$site"/$entry; do
                [ -e "$path" ] && ln -s "$(cd "$(dirname "$path")" && pwd)/$(basename "$path")" "$shim/"
            done
        done
        export PYTHONPATH="$PYTHONPATH:$shim"
        return 0
    done
}
borrow pytest pytest _pytest pluggy iniconfig packaging pygments py.py
borrow llguidance llguidance "llguidance-*.dist-info"
borrow msgpack msgpack
borrow safetensors safetensors
borrow tokenizers tokenizers "tokenizers-*.dist-info"

status=0
if "$PY" -c "import pytest" > /dev/null 2>&1; then
    log "kernel tests (cuda, bf16)..."
    timeout -k 5 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
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

log "engine at TP 1 on cuda (tensor-parallel path, issue 28)..."
# the demo model's weights go to a throwaway cache, not the machine's
PDSERVE_CACHE_DIR="$(mktemp -d)" timeout -k 5 60 "$PY" -m perf.tp_check --device cuda \
    --tensor-parallel-size 1 --json "$OUT/tp1.json" > "$OUT/tp1.txt" 2>&1
rc=$?
log "tp1 rc=$rc: $(grep '^tp_check' "$OUT/tp1.txt" || tail -n 1 "$OUT/tp1.txt")"
[ $rc -eq 0 ] || status=1

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

log "UCX between two processes on this GPU host (issue 29)..."
# The libucx wheel's perftest (dev venv, or the machine's own ucxx); its lib dir for the loader.
UCX_BIN=""
for site in .venv/lib/python3*/site-packages \
    "$("$PY" -c 'import libucx, os; print(os.path.dirname(os.path.dirname(libucx.__file__)))' 2> /dev/null)"; do
    [ -x "$site/libucx/bin/ucx_perftest" ] && UCX_BIN="$site/libucx/bin" && break
done
if [ -z "$UCX_BIN" ]; then
    log "ucx transport: no ucx_perftest (libucx wheel) here; not recorded"
else
    # what ucxx and pdserve's ucx_config set in a worker; -e: ucxx's endpoints handle peer failure
    ucx_env=(LD_LIBRARY_PATH="$UCX_BIN/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        UCX_MM_ERROR_HANDLING=y UCX_KEEPALIVE_INTERVAL=1s UCX_RNDV_THRESH=8192
        UCX_RNDV_FRAG_MEM_TYPE=cuda UCX_MAX_RNDV_RAILS=1 UCX_PROTO_INFO=y UCX_WARN_UNUSED_ENV_VARS=n)
    port=$((20000 + RANDOM % 20000))
    env "${ucx_env[@]}" timeout -k 5 60 "$UCX_BIN/ucx_perftest" -p "$port" -e \
        > "$OUT/ucx_gpu_server.txt" 2>&1 &
    server=$!
    sleep 2
    env "${ucx_env[@]}" timeout -k 5 60 "$UCX_BIN/ucx_perftest" 127.0.0.1 -p "$port" -e \
        -t tag_bw -m cuda,cuda -s 8388608 -n 200 > "$OUT/ucx_gpu_transport.txt" 2>&1
    rc=$?
    kill "$server" 2> /dev/null
    wait "$server" 2> /dev/null
    # the lanes of tagged sends from GPU memory, as UCX_PROTO_INFO logged them
    lanes="$(awk '/cfg#/ { on = /tagged message by ucp_tag_send\*[^|]* from cuda/; next } on' \
        "$OUT/ucx_gpu_transport.txt" | grep -oE '\b[a-z][a-z0-9_]*/[A-Za-z0-9_.:-]+' \
        | sort -u | tr '\n' ' ')"
    final="$(grep '^Final:' "$OUT/ucx_gpu_transport.txt" | awk '{print $(NF-2) " MB/s"}')"
    log "ucx transport rc=$rc, GPU memory between two processes: ${lanes:-no protocol table} ${final:+($final, 8 MiB tag_bw)}"
    case " $lanes" in
        *" cuda_ipc/"*) ;;
        *) log "WARN: UCX did not pick cuda_ipc between two processes of this host: KV moves through host memory or TCP (see $OUT/ucx_gpu_transport.txt)" ;;
    esac
fi

log "roofline of the engine's passes on this GPU (issue 34)..."
# the random model goes to a temp dir, the peaks are measured, not read from a cache
PDSERVE_CACHE_DIR="$(mktemp -d)" timeout -k 5 90 "$PY" -m perf.roofline_bench --device cuda \
    --random-shape llama-1b --reps 1 --warm-steps 3 --steps 16 \
    --json "$OUT/roofline_gpu.json" --plot "$OUT/roofline_gpu.png" > "$OUT/roofline_gpu.txt" 2>&1
rc=$?
log "roofline rc=$rc"
sed -n '/^roof:/,$p' "$OUT/roofline_gpu.txt" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || { tail -n 5 "$OUT/roofline_gpu.txt" | tee -a "$OUT/summary.txt"; status=1; }

log "done, status=$status; results in $OUT"
exit $status
