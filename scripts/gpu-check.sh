#!/usr/bin/env bash
# The GPU check of the CUDA backend, in one go (about 8 minutes at most on a
# 16-core machine with one H200):
#   1. configure build-gpu/ with EPX_WITH_CUDA=ON for sm_90, build the CUDA
#      conformance tests and the CUDA benchmark;
#   2. run the conformance table (R emulated ranks on the GPU against the
#      reference the in-process backend matches bit for bit), and a few small
#      cases under compute-sanitizer when it is there;
#   3. run the benchmark (8 ranks x 4096 tokens, hidden 7168, top-8 of 256,
#      bf16) and PyTorch's index_select / index_add_ doing the same job;
#   4. print a short table last.
# Logs and JSON go to $OUT when it is set (the device tool's folder), else to
# build-gpu/logs. Exit status: 0 when the tests passed and both benchmarks ran.
#
#   bash scripts/gpu-check.sh            # all of it
#   BENCH_ARGS="--reps 10" bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
LOGS=${OUT:-$BUILD/logs}
JOBS=${JOBS:-$(nproc)}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$LOGS"
export PATH=/usr/local/cuda/bin:$PATH
status=0
section() { printf '\n==== %s ====\n' "$1"; }

section "device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv 2>&1 | tee "$LOGS/device.txt"
nvcc --version | tail -2 | tee -a "$LOGS/device.txt"

section "configure + build ($BUILD, sm_90, $JOBS jobs)"
start=$(date +%s)
if ! timeout 270 bash -c "cmake -S . -B '$BUILD' -DCMAKE_BUILD_TYPE=Release -DEPX_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DEPX_WITH_MPI=OFF \
      -DEPX_BUILD_APPS=OFF && cmake --build '$BUILD' -j$JOBS --target epx_cuda_tests epx_cuda_exchange_bench" \
      >"$LOGS/build.log" 2>&1; then
  tail -40 "$LOGS/build.log"
  echo "gpu-check: the build failed (log: $LOGS/build.log)"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"

section "CUDA conformance tests"
start=$(date +%s)
timeout 150 "$BUILD/tests/epx_cuda_tests" --gtest_brief=1 >"$LOGS/cuda_tests.log" 2>&1
tests_rc=$?
tail -25 "$LOGS/cuda_tests.log"
echo "tests: exit $tests_rc in $(( $(date +%s) - start )) s"
[[ $tests_rc -eq 0 ]] || status=1

if command -v compute-sanitizer >/dev/null; then
  section "compute-sanitizer memcheck (a few small cases)"
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/tests/epx_cuda_tests" --gtest_brief=1 \
    --gtest_filter='CudaHand.*:CudaErrors.*:CudaPeerMemory.*:Cuda/CudaConformance.*/2ranks_2nodes_hierarchical_bf16' \
    >"$LOGS/memcheck.log" 2>&1
  memcheck_rc=$?
  tail -5 "$LOGS/memcheck.log"
  echo "memcheck: exit $memcheck_rc"
  [[ $memcheck_rc -eq 0 ]] || status=1
fi

section "benchmark: epx CUDA backend vs device copy"
timeout 60 "$BUILD/bin/epx_cuda_exchange_bench" --json "$LOGS/cuda_bench.json" $BENCH_ARGS 2>&1 | tee "$LOGS/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

section "benchmark: PyTorch index_select / index_add_"
PYTHONUNBUFFERED=1 timeout 60 python3 bench/torch_exchange.py --json "$LOGS/torch_bench.json" $BENCH_ARGS 2>&1 | tee -a "$LOGS/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

section "summary"
python3 - "$LOGS/cuda_bench.json" "$LOGS/torch_bench.json" "$tests_rc" <<'PY' 2>&1 | tee "$LOGS/summary.txt"
import json, sys
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return {}
e, t, rc = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
print(f"conformance tests: {'passed' if rc == '0' else 'FAILED (exit ' + rc + ')'}")
if not e:
    print("epx benchmark: no result"); sys.exit(0)
gb = lambda ms: e["bytes"] / (ms * 1e-3) / 1e9
print(f"{e.get('device')}: {e['ranks']} ranks x {e['tokens']} tokens, hidden {e['hidden']}, top-{e['topk']} of {e['experts']}, "
      f"bf16, {e['bytes'] / 1e6:.0f} MB per call, median of {e['reps']}")
print(f"{'operation':<18}{'epx ms':>9}{'GB/s':>8}{'vs copy':>9}{'torch ms':>10}{'vs torch':>10}")
rows = [("dispatch", e["dispatch_ms"], t.get("torch_dispatch_ms")),
        ("dispatch cached", e["dispatch_cached_ms"], t.get("torch_dispatch_ms")),
        ("combine", e["combine_ms"], t.get("torch_combine_ms")),
        ("d2d copy", e["copy_ms"], None)]
for name, ms, tms in rows:
    vs_t = f"{tms / ms:>9.2f}x" if tms else f"{'-':>10}"
    ts = f"{tms:>10.3f}" if tms else f"{'-':>10}"
    print(f"{name:<18}{ms:>9.3f}{gb(ms):>8.0f}{e['copy_ms'] / ms:>8.2f}x{ts}{vs_t}")
print("goals: >= 0.70x the copy, >= 2x PyTorch")
PY
exit $status
