#!/usr/bin/env bash
# The whole GPU check in one call: the GPU test suite on 2 GPUs and on all local GPUs, then the benchmark,
# full logs under OUT_DIR, a short summary table last.
#   scripts/gpu-check.sh OUT_DIR [STEPS]
# STEPS (default "tests bench"): any of tests, tests-all, tests-2, bench, bench-all, bench-2, ll, ll-nvshmem,
# python, kill, soak, and the low-latency suite per transport (below), separated by spaces. Uses BUILD_DIR (default build)
# if its binaries are there (built elsewhere and carried), else builds into build-gpu.
#
# Low-latency transports (docs/design.md): ll-ipc, ll-nvshmem-ptr, ll-nvshmem-forced run the low-latency part
# of the GPU suite (cases "ll:") on 2 GPUs and on all GPUs with, in turn, the CUDA IPC buffer
# (EPX_DISABLE_NVSHMEM=1), NVSHMEM memory through peer pointers (the default of an NVSHMEM build), and NVSHMEM
# puts to every other rank (EPX_LL_FORCE_NVSHMEM=1); each run fails unless that transport ran
# (--expect-transport). Append -2 or -all for one rank count (ll-ipc-2, ll-nvshmem-forced-all, ...);
# ll-transports is all three. The NVSHMEM ones say SKIPPED on a build without NVSHMEM. ll-nvshmem is the
# low-latency benchmark with EPX_LL_FORCE_NVSHMEM=1 (ll is the same with the default transport).
#
# Internode (needs an NVSHMEM build): internode-DxG runs the high-throughput suite on D NVLink domains of G
# GPUs each (D*G ranks; the timeout suite too), e.g. internode-2x1, internode-1x2, internode-2x2;
# bench-internode-D runs epx-bench internode on all local GPUs split into D domains.
#
# kill: tests/python/test_kill.py (a rank SIGKILLed during each operation; one line per case in
# OUT_DIR/kill-report.txt), then its low-latency cases again over the CUDA IPC buffer (EPX_DISABLE_NVSHMEM=1) on an
# NVSHMEM build. soak: tests/python/soak.py on 2 GPUs, SOAK_ITERATIONS (default 10000) iterations.
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
  grep -E -A4 "^\[FAIL\]" "$log" | head -30  # the failing case and its per-rank messages
}
has_nvshmem=$("$BUILD_DIR/tests/epx_gpu_tests" --build-info 2>/dev/null | grep -c "nvshmem: yes" || true)
run_ll() {  # transport ranks
  local t=$1 r=$2 log="$OUT/ll-$1-$2.log" start=$SECONDS
  local env_vars=()
  case $t in
    ipc) [ "$has_nvshmem" = 1 ] && env_vars=(EPX_DISABLE_NVSHMEM=1); expect=cuda-ipc ;;
    nvshmem-ptr) expect=nvshmem ;;
    nvshmem-forced) env_vars=(EPX_LL_FORCE_NVSHMEM=1); expect=nvshmem-forced ;;
  esac
  if [ "$t" != ipc ] && [ "$has_nvshmem" != 1 ]; then
    summary+=("ll       R=$r  $t  SKIPPED: $BUILD_DIR was built without NVSHMEM")
    return
  fi
  env "${env_vars[@]}" timeout ${TEST_TIMEOUT:-280} "$BUILD_DIR/tests/epx_gpu_tests" --gpus "$r" \
    --no-internode --filter "ll:" --expect-transport "$expect" >"$log" 2>&1
  local rc=$?
  local line transport
  line=$(grep -E "suite on .* cases passed" "$log" | tail -1)
  transport=$(grep -m1 "^low-latency transport:" "$log" | sed 's/^low-latency transport: //')
  local took=$((SECONDS - start))
  summary+=("ll       R=$r  $t rc=$rc  ${line:-no summary}  [${transport:-transport unknown}]  ($took s)")
  grep -E -A4 "^\[FAIL\]" "$log" | head -30  # the failing case and its per-rank messages
}
run_ll_counts() {  # transport [2|all]
  local which=${2:-both}
  [ "$which" != all ] && run_ll "$1" 2
  [ "$which" != 2 ] && [ "$ngpu" -gt 2 ] && run_ll "$1" "$ngpu"
  [ "$which" = all ] && [ "$ngpu" -le 2 ] && run_ll "$1" "$ngpu"
  return 0
}
run_internode() {  # DxG
  local split=$1 log="$OUT/internode-$1.log" start=$SECONDS
  local r=$(( ${split%x*} * ${split#*x} ))
  if [ "$has_nvshmem" != 1 ]; then
    summary+=("internode $split SKIPPED: $BUILD_DIR was built without NVSHMEM"); return
  fi
  timeout ${TEST_TIMEOUT:-280} "$BUILD_DIR/tests/epx_gpu_tests" --gpus "$r" --internode "$split" >"$log" 2>&1
  local rc=$?
  local line; line=$(grep -E "suite on .* cases passed" "$log" | tail -1)
  summary+=("internode $split  rc=$rc  ${line:-no summary}  ($((SECONDS - start)) s)")
  grep -E -A6 "^\[FAIL\]" "$log" | head -40
}
run_bench() {  # ranks mode [args]
  local r=$1 mode=$2; shift 2
  local tag=${BENCH_TAG:-} log="$OUT/bench-$mode${BENCH_TAG:-}-$r.log" start=$SECONDS
  timeout ${BENCH_TIMEOUT:-240} "$BUILD_DIR/tools/bench/epx-bench" "$mode" --gpus "$r" \
    --json "$OUT/bench-$mode$tag-$r.json" "$@" >"$log" 2>&1
  local rc=$?
  summary+=("bench    R=$r  $mode$tag rc=$rc ($((SECONDS - start)) s)")
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
    ll-nvshmem)
      if [ "$has_nvshmem" = 1 ]; then
        BENCH_TAG=-nvshmem-forced EPX_LL_FORCE_NVSHMEM=1 run_bench "$ngpu" low-latency
      else
        summary+=("bench    ll-nvshmem SKIPPED: $BUILD_DIR was built without NVSHMEM")
      fi ;;
    python)  # the pytest suites against this build's libepx, then the host overhead per call (2 GPUs)
      start=$SECONDS
      EPX_LIBRARY="$PWD/$BUILD_DIR/libepx.so" timeout ${PYTHON_TIMEOUT:-300} bash python/tests/run.sh \
        --ignore=tests/python/test_kill.py >"$OUT/python.log" 2>&1
      rc=$?
      summary+=("python   rc=$rc  $(tail -1 "$OUT/python.log")  ($((SECONDS - start)) s)")
      grep -E "FAILED|Error" "$OUT/python.log" | head -10
      EPX_LIBRARY="$PWD/$BUILD_DIR/libepx.so" PYTHONPATH=python timeout 120 python3 tests/python/overhead.py --nproc 2 \
        --json "$OUT/overhead.json" >"$OUT/overhead.log" 2>&1
      summary+=("overhead rc=$?  (python host us per call over ctypes: $OUT/overhead.log)")
      tail -8 "$OUT/overhead.log" ;;
    kill)  # killed ranks (the step "python" leaves them out: each case is a fresh pair of processes)
      start=$SECONDS
      : >"$OUT/kill-report.txt"
      EPX_KILL_REPORT="$OUT/kill-report.txt" EPX_LIBRARY="$PWD/$BUILD_DIR/libepx.so" timeout ${KILL_TIMEOUT:-600} \
        bash python/tests/run.sh -rA -k test_killed_rank >"$OUT/kill.log" 2>&1
      summary+=("kill     rc=$?  $(tail -1 "$OUT/kill.log")  ($((SECONDS - start)) s)")
      if [ "$has_nvshmem" = 1 ]; then
        start=$SECONDS
        echo "# EPX_DISABLE_NVSHMEM=1 (low-latency region in the CUDA IPC buffer)" >>"$OUT/kill-report.txt"
        EPX_DISABLE_NVSHMEM=1 EPX_KILL_REPORT="$OUT/kill-report.txt" EPX_LIBRARY="$PWD/$BUILD_DIR/libepx.so" \
          timeout ${KILL_TIMEOUT:-600} bash python/tests/run.sh -rA -k "test_killed_rank and ll_" \
          >"$OUT/kill-ipc.log" 2>&1
        summary+=("kill     ll over CUDA IPC rc=$?  $(tail -1 "$OUT/kill-ipc.log")  ($((SECONDS - start)) s)")
      fi
      cat "$OUT/kill-report.txt" ;;
    soak)
      start=$SECONDS
      EPX_LIBRARY="$PWD/$BUILD_DIR/libepx.so" PYTHONPATH=python timeout ${SOAK_TIMEOUT:-600} "$(bash scripts/python-env.sh | tail -n 1)" \
        tests/python/soak.py --iterations "${SOAK_ITERATIONS:-10000}" --json "$OUT/soak.json" >"$OUT/soak.log" 2>&1
      summary+=("soak     rc=$?  $(tail -1 "$OUT/soak.log")  ($((SECONDS - start)) s)")
      tail -8 "$OUT/soak.log" ;;
    ll-transports) for t in ipc nvshmem-ptr nvshmem-forced; do run_ll_counts "$t"; done ;;
    ll-ipc|ll-nvshmem-ptr|ll-nvshmem-forced) run_ll_counts "${step#ll-}" ;;
    ll-ipc-2|ll-nvshmem-ptr-2|ll-nvshmem-forced-2) t=${step#ll-}; run_ll_counts "${t%-2}" 2 ;;
    ll-ipc-all|ll-nvshmem-ptr-all|ll-nvshmem-forced-all) t=${step#ll-}; run_ll_counts "${t%-all}" all ;;
    internode-*x*) run_internode "${step#internode-}" ;;
    bench-internode-*)
      if [ "$has_nvshmem" = 1 ]; then
        BENCH_TAG=-d${step#bench-internode-} run_bench "$ngpu" internode --domains "${step#bench-internode-}"
      else
        summary+=("bench    internode SKIPPED: $BUILD_DIR was built without NVSHMEM")
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
echo
echo "==== gpu-check summary ($(date -u +%FT%TZ))"
for s in "${summary[@]}"; do echo "$s"; done
