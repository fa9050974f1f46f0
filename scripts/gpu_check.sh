#!/usr/bin/env bash
# Every GPU check of the project in one command, for a CUDA machine that has torch, triton and
# transformers but none of our other dependencies and no network:
#
#   1. installs our other dependencies from wheels placed in `.whl/` or `wheels/` at the repo root
#      (or $WHEEL_DIR) into /tmp/site (--no-deps --target, on PYTHONPATH: the servers' children
#      inherit it); the project itself runs from src/ on PYTHONPATH;
#   2. runs `pytest -m gpu tests/gpu` (parity with transformers, backends, CUDA graphs, overlap,
#      one server end to end), at most 120 s a test;
#   3. runs benchmarks/bench_gpu.py: copy bandwidth and bf16 matmul ceilings, decode latency at
#      batch 1/32/128 against the memory-bandwidth floor, prefill against the matmul rate, offline
#      throughput on 1000 prompts with input/output lengths U[100, 1024], on random weights in the
#      shape of Llama-3-8B in bfloat16; then, side by side in the same process, decode without CUDA
#      graphs and a 200-prompt offline run with the overlap loop on and off; and a kernel table of
#      the decode step at batch 1 and 128 (torch.profiler, profile_decode.txt);
#   4. prints a summary table last.
# Budget: about 7 minutes (each step has its own time limit, so the table always comes out).
#
# Usage: scripts/gpu_check.sh [--dry-run] [--skip-tests] [--skip-bench] [PYTEST_ARGS...]
#   --dry-run   no GPU needed: checks the dependencies and wheels, collects the GPU tests and runs
#               the benchmark on a toy model on the CPU (the plumbing), then prints the table.
#   PYTEST_ARGS replace `tests/gpu` (e.g. a rerun of one test file or -k expression).
# Logs, JSON and the table go to $OUT (when set, as on the device machine) or ./gpu_check_out.
#
# Making the wheels (Python 3.12, x86-64), from the repo root, for what the machine's image lacks
# (it has torch, triton, transformers, numpy, safetensors, tokenizers, httpx, psutil, uvloop,
# prometheus-client, pytest, pytest-timeout, hypothesis):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps -d .whl --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     pyzmq msgspec fastapi starlette pydantic pydantic-core uvicorn setproctitle typing-inspection \
#     annotated-types typing-extensions opentelemetry-api xgrammar apache-tvm-ffi orjson httptools
# (the versions this checkout's environment has; --no-deps, so name every missing dependency).

set -uo pipefail

DRY_RUN=0
RUN_TESTS=1
RUN_BENCH=1
PYTEST_TARGETS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --skip-tests) RUN_TESTS=0 ;;
        --skip-bench) RUN_BENCH=0 ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) PYTEST_TARGETS+=("$arg") ;;
    esac
done
[ ${#PYTEST_TARGETS[@]} = 0 ] && PYTEST_TARGETS=(tests/gpu)

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT_DIR"
TEST_LIMIT_S="${GPU_CHECK_TEST_LIMIT_S:-170}"
BENCH_LIMIT_S="${GPU_CHECK_BENCH_LIMIT_S:-230}"
OFFLINE_DEADLINE_S="${GPU_CHECK_OFFLINE_DEADLINE_S:-75}"
VARIANTS="${GPU_CHECK_VARIANTS:-graphs_off,overlap_off}"
START=$(date +%s)
export PYTHONUNBUFFERED=1

log() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

# ------------------------------------------------------------------ 1. dependencies
# pip name -> import name, for what the machine may lack.
DEPS="pyzmq:zmq msgspec:msgspec fastapi:fastapi uvicorn:uvicorn httptools:httptools uvloop:uvloop orjson:orjson psutil:psutil
setproctitle:setproctitle prometheus-client:prometheus_client tqdm:tqdm pydantic:pydantic requests:requests
numpy:numpy safetensors:safetensors tokenizers:tokenizers httpx:httpx pytest:pytest pytest-timeout:pytest_timeout
hypothesis:hypothesis xgrammar:xgrammar"

missing_deps() {
    local missing=()
    for pair in $DEPS; do
        "$PY" -c "import ${pair#*:}" >/dev/null 2>&1 || missing+=("${pair%%:*}")
    done
    echo "${missing[@]:-}"
}

WHEELS=""
for candidate in "${WHEEL_DIR:-}" "$REPO/.whl" "$REPO/wheels" "$REPO/../wheels"; do
    if [ -n "$candidate" ] && [ -d "$candidate" ]; then WHEELS="$(cd "$candidate" && pwd)"; break; fi
done

DEPS_STATUS="ok"
MISSING="$(missing_deps)"
if [ -n "$MISSING" ]; then
    if [ -z "$WHEELS" ]; then
        DEPS_STATUS="missing: $MISSING (no wheels/ folder; see the pip download command at the top)"
    elif [ "$DRY_RUN" = 1 ]; then
        DEPS_STATUS="would install from $WHEELS: $MISSING"
    else
        log "installing from $WHEELS into /tmp/site: $MISSING"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl 2>&1 | tail -5
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        MISSING="$(missing_deps)"
        [ -n "$MISSING" ] && DEPS_STATUS="still missing after install: $MISSING"
    fi
fi
log "dependencies: $DEPS_STATUS"

# ------------------------------------------------------------------ 2. the project
# src/ on the path: the servers' children inherit it.
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import engine, torch; print('engine from', engine.__file__); print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | sed 's/^/  /'
if [ "$DRY_RUN" = 0 ]; then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/  GPU: /'
    "$PY" -c "import triton; print('  triton', triton.__version__)" 2>&1
fi

# ------------------------------------------------------------------ 3. GPU tests
TEST_STATUS="skipped"
if [ "$RUN_TESTS" = 1 ]; then
    cd "$REPO" || exit 1
    if [ "$DRY_RUN" = 1 ]; then
        log "collecting the GPU tests (dry run: not running them)"
        "$PY" -m pytest "${PYTEST_TARGETS[@]}" -m gpu --collect-only -q -p no:cacheprovider >"$OUT_DIR/pytest_gpu.log" 2>&1
        rc=$?
        TEST_STATUS="collected only (dry run): $(grep -Eo '[0-9]+ tests? collected' "$OUT_DIR/pytest_gpu.log" | tail -1), rc=$rc"
    else
        log "pytest -m gpu (limit ${TEST_LIMIT_S}s)"
        timeout -k 10 "$TEST_LIMIT_S" "$PY" -m pytest "${PYTEST_TARGETS[@]}" -m gpu -q -p no:cacheprovider \
            --durations=15 --timeout 120 -o junit_family=xunit1 --junitxml "$OUT_DIR/pytest_gpu.xml" \
            2>&1 | tee "$OUT_DIR/pytest_gpu.log" | grep -E "passed|failed|error|FAILED|ERROR" | tail -25
        rc=${PIPESTATUS[0]}
        summary="$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$OUT_DIR/pytest_gpu.log" | tail -1 | tr -d '=' | xargs)"
        [ "$rc" = 124 ] && summary="time limit (${TEST_LIMIT_S}s) hit; $summary"
        TEST_STATUS="rc=$rc ${summary:-no summary line}"
    fi
    log "tests: $TEST_STATUS"
fi

# ------------------------------------------------------------------ 4. GPU benchmarks
BENCH_STATUS="skipped"
TABLE="$OUT_DIR/bench_gpu_table.txt"
rm -f "$TABLE"
if [ "$RUN_BENCH" = 1 ]; then
    cd "$REPO" || exit 1
    if [ "$DRY_RUN" = 1 ]; then
        log "benchmark plumbing on the CPU with a toy model (dry run)"
        BENCH_ARGS=(--model tiny --device cpu --copy-gib 0.02 --matmul-n 256 --max-total-tokens 60000
                    --decode-batch-sizes 1,4 --decode-context 64 --decode-steps 4 --prefill-batch 2 --prefill-len 64
                    --num-prompts 16 --input-len 10 60 --output-len 5 30 --variants "$VARIANTS" --compare-prompts 8)
        LIMIT=120
    else
        log "bench_gpu.py (limit ${BENCH_LIMIT_S}s, offline deadline ${OFFLINE_DEADLINE_S}s)"
        BENCH_ARGS=(--offline-deadline-s "$OFFLINE_DEADLINE_S" --variants "$VARIANTS"
                    --profile-batch-sizes 1,128 --profile-file "$OUT_DIR/profile_decode.txt")
        LIMIT="$BENCH_LIMIT_S"
    fi
    timeout -k 10 "$LIMIT" "$PY" benchmarks/bench_gpu.py "${BENCH_ARGS[@]}" \
        --result-file "$OUT_DIR/bench_gpu.json" --table-file "$TABLE" >"$OUT_DIR/bench_gpu.log" 2>&1
    rc=$?
    BENCH_STATUS="rc=$rc"
    [ "$rc" = 124 ] && BENCH_STATUS="rc=124 (time limit ${LIMIT}s hit)"
    [ "$rc" != 0 ] && tail -20 "$OUT_DIR/bench_gpu.log"
    log "benchmarks: $BENCH_STATUS"
fi

# ------------------------------------------------------------------ 5. summary, last
echo
echo "=================== gpu_check summary ($( [ "$DRY_RUN" = 1 ] && echo 'DRY RUN, no GPU steps' || echo "$(date -u +%F)" )) ==================="
printf '| %-12s | %s\n' "dependencies" "$DEPS_STATUS"
printf '| %-12s | %s\n' "gpu tests" "$TEST_STATUS"
printf '| %-12s | %s\n' "benchmarks" "$BENCH_STATUS"
printf '| %-12s | %ss\n' "elapsed" "$(( $(date +%s) - START ))"
if [ -s "$TABLE" ]; then
    cat "$TABLE"
fi
case "$TEST_STATUS" in rc=0*|skipped|collected*rc=0) ;; *) exit 1 ;; esac
case "$BENCH_STATUS" in rc=0|skipped) ;; *) exit 1 ;; esac
exit 0
