#!/usr/bin/env bash
# One run of everything that needs a real GPU, on a machine that has one (CI has none):
#   1. bench/bench_gpu.py --quick: HBM-tier lookups and updates, all hits and with misses (keys/s, syncs per call),
#      bench/profile_gpu.py: where an all-hit lookup's and update's host time goes (kernels, operators),
#      and bench/syncs_per_call.py: the host syncs of each budgeted public call, counted on the device;
#   2. the main job (python -m examples.dlrm, defaults; on CUDA where present);
#   3. the test suite on the real device (tests/realcuda.py: the CUDA fixtures run on the GPU, host syncs
#      counted through torch's sync debug mode; tests/test_gpu_real.py: autograd, streams, memory, bits).
# Logs and results go to $OUT (default ./gpu-check-out). Wheels in .whl/ (for a machine that cannot reach
# a package index) are installed first; SKIP_BENCH=1 leaves out bench_gpu, SKIP_REST=1 the second round
# of tests (those that keep the cache on the host). Where only a few files may come back, write elsewhere
# and pack them (SKIP_DEMO=1 leaves out the main job):
#   R=$OUT; OUT=/tmp/gc bash scripts/gpu-check.sh; tar czf $R/gc.tgz -C /tmp/gc .
# Usage: bash scripts/gpu-check.sh [TEST_SECONDS [DEMO_SECONDS]]  (TEST_SECONDS=0 runs no tests)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
test_s="${1:-320}"  # the whole suite took ~290 s on 16 cores (H100, 2026-11-26)
demo_s="${2:-150}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    # into the interpreter's own environment, so that the tests' subprocesses (which set PYTHONPATH
    # themselves) import them too; into /tmp/site where that environment is read-only
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
        || { "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                 .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"; }
fi
{
    date -u
    nvidia-smi -L
    "$py" -c "import torch, numpy, numba, grpc, google.protobuf as pb, rocksdict, lmdb
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))
print('numpy', numpy.__version__, 'numba', numba.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
    nproc
} 2>&1 | tee "$out/env.txt"

if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== bench_gpu"
    t0=$SECONDS
    timeout 75 "$py" bench/bench_gpu.py --quick --out "$out" 2>&1 | tee "$out/bench.log"
    echo "bench rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$out/bench.log"
    echo "== profile_gpu"
    timeout 60 "$py" bench/profile_gpu.py --out "$out" >"$out/profile.log" 2>&1
    echo "profile rc=$?" | tee -a "$out/profile.log"
    head -n 14 "$out/gpu-profile.md" 2>/dev/null
fi

echo "== host syncs per public call"
timeout 60 "$py" bench/syncs_per_call.py --out "$out" 2>&1 | tee "$out/syncs.log"

if [ -z "${SKIP_DEMO:-}" ]; then
echo "== demo"
# alone: its torch threads and the test workers' would oversubscribe the cores; SIGABRT at the limit makes
# faulthandler print every thread's stack, so a hang shows where it waits
t0=$SECONDS
PYTHONFAULTHANDLER=1 timeout -s ABRT "$demo_s" "$py" -m examples.dlrm --json "$out/demo.json" >"$out/demo.log" 2>&1
echo "demo rc=$? in $((SECONDS - t0)) s" >>"$out/demo.log"
tr '\r' '\n' <"$out/demo.log" | grep -v "^train:\|^eval:\|^data:\|^keysets" | tail -n 40
fi

[ "$test_s" -gt 0 ] || exit 0  # TEST_SECONDS=0: no tests
echo "== tests"
# -o addopts= drops the project's -q (it cancels -v); SIGINT at the limit lets pytest write its summary and the
# JUnit file (SIGTERM kills it before either); a per-test timeout where pytest-timeout is installed. Two
# rounds: the files that put the cache on the GPU first (their results are what a GPU run is for), then
# the rest of the suite with the time left.
per_test=()
"$py" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
gpu_files=(tests/test_gpu_real.py tests/test_triton_probe.py tests/test_gpu_path.py tests/test_cache.py
           tests/test_prefetch.py tests/test_nn.py tests/test_index.py tests/test_init.py tests/test_transparency.py
           tests/test_found_slots.py tests/test_tier_rows.py tests/test_fused.py tests/test_export_delta.py)
run_tests() {  # NAME SECONDS PYTEST-ARGS...
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    # each failure's traceback goes to failures-NAME.log as it happens (tests/conftest.py): an interrupt at
    # the limit can break xdist's summary (on an H100 two failures came back without one)
    EMBCACHE_FAILURE_LOG="$out/failures-$name.log" OMP_NUM_THREADS=2 NUMBA_NUM_THREADS=2 \
        timeout -s INT -k 20 "$limit" "$py" -m pytest -o addopts= \
        -p no:cacheprovider -n 14 --dist loadfile -v -rfE --durations=20 -o faulthandler_timeout=100 \
        "${per_test[@]}" --junitxml="$out/junit-$name.xml" "$@" >"$out/pytest-$name.log" 2>&1
    echo "pytest $name rc=$? in $((SECONDS - t0)) s" >>"$out/pytest-$name.log"
    grep -E "FAILED|ERROR|Timeout|rc=" "$out/pytest-$name.log" | sort | uniq | head -n 80
}
t_start=$SECONDS
run_tests gpu $((test_s * 2 / 3)) "${gpu_files[@]}"
left=$((test_s - (SECONDS - t_start)))
ignore=()
for f in "${gpu_files[@]}" tests/test_docs.py tests/test_deploy.py tests/test_packaging.py; do ignore+=(--ignore="$f"); done
[ -z "${SKIP_REST:-}" ] && [ "$left" -gt 30 ] && run_tests rest "$left" "${ignore[@]}"
