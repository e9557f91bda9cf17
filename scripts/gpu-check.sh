#!/usr/bin/env bash
# The whole GPU check in one call: the GPU test suite on 2 GPUs and on all local GPUs, then the benchmark,
# full logs under OUT_DIR, a short summary table last.
#   scripts/gpu-check.sh OUT_DIR [STEPS]
# STEPS (default "tests bench"): any of tests, tests-all, tests-2, bench, bench-all, bench-2, ll, python,
# separated by spaces. Uses BUILD_DIR (default build) if its binaries are there (built elsewhere and carried),
# else builds into build-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${1:?usage: scripts/gpu-check.sh OUT_DIR [STEPS]}
STEPS=${2:-"tests bench"}
BUILD_DIR=${BUILD_DIR:-build}
mkdir -p "$OUT"
summary=()

if [ ! -x "$BUILD_DIR/tests/epx_gpu_tests" ]; then
  echo "gpu-check: building into build-gpu"
  BUILD_DIR=build-gpu
  scripts/setup.sh "$BUILD_DIR" >"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
fi
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
echo "gpu-check: $ngpu GPUs, build $BUILD_DIR"
nvidia-smi -L >"$OUT/machine.txt" 2>&1; nvidia-smi topo -m >>"$OUT/machine.txt" 2>&1

run_tests() {  # ranks
  local r=$1 log="$OUT/tests-$1.log" start=$SECONDS
  timeout ${TEST_TIMEOUT:-280} "$BUILD_DIR/tests/epx_gpu_tests" --gpus "$r" >"$log" 2>&1
  local rc=$?
  local line; line=$(grep -E "suite on .* cases passed" "$log" | tail -1)
  summary+=("tests    R=$r  rc=$rc  ${line:-no summary}  ($((SECONDS - start)) s)")
  grep -E "^\[FAIL\]|^  rank|error" "$log" | head -20
}
run_bench() {  # ranks mode [args]
  local r=$1 mode=$2; shift 2
  local log="$OUT/bench-$mode-$r.log" start=$SECONDS
  timeout ${BENCH_TIMEOUT:-240} "$BUILD_DIR/tools/bench/epx-bench" "$mode" --gpus "$r" --json "$OUT/bench-$mode-$r.json" "$@" >"$log" 2>&1
  local rc=$?
  summary+=("bench    R=$r  $mode rc=$rc ($((SECONDS - start)) s)")
  cat "$log"
}

for step in $STEPS; do
  case $step in
    tests) run_tests 2; [ "$ngpu" -gt 2 ] && run_tests "$ngpu" ;;
    tests-2) run_tests 2 ;;
    tests-all) run_tests "$ngpu" ;;
    bench) run_bench "$ngpu" intranode; [ "$ngpu" -gt 2 ] && run_bench 2 intranode --sms 24 ;;
    bench-all) run_bench "$ngpu" intranode ;;
    bench-2) run_bench 2 intranode --sms 24 ;;
    ll) run_bench "$ngpu" low-latency ;;
    *) echo "unknown step $step" ;;
  esac
done
echo
echo "==== gpu-check summary ($(date -u +%FT%TZ))"
for s in "${summary[@]}"; do echo "$s"; done
