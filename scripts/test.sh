#!/usr/bin/env bash
# Sets up, builds and runs every test this machine can run, for both variants of the build: with NVSHMEM (found or
# installed by the set-up; the internode mode needs it) in BUILD_DIR, and without it in BUILD_DIR-no-nvshmem. The CPU
# tests and the Python tests (with the Python scripts/python-env.sh picks or sets up) run against each; then the
# first is installed and examples/cpp built against it (scripts/check-install.sh); the GPU suite, on all local GPUs
# (one rank on one GPU; nothing without one), runs against the first (intranode, low-latency and every internode
# split it can form).
# In CI (CI set) the NVSHMEM variant is required: EPX_NVSHMEM=1 unless set otherwise.
#   scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${EPX_BUILD_DIR:-build}
[ -n "${CI:-}" ] && export EPX_NVSHMEM=${EPX_NVSHMEM:-1}
scripts/setup.sh "$BUILD_DIR"
variants=("$BUILD_DIR")
if grep -qx "EPX_NVSHMEM:STRING=ON" "$BUILD_DIR/CMakeCache.txt"; then
  echo "== Build without NVSHMEM ($BUILD_DIR-no-nvshmem)"
  EPX_NVSHMEM=0 scripts/setup.sh "$BUILD_DIR-no-nvshmem"
  variants+=("$BUILD_DIR-no-nvshmem")
fi

echo "== Format"
if command -v clang-format >/dev/null 2>&1; then
  scripts/format.sh --check
elif [ -n "${CI:-}" ]; then
  echo "clang-format is missing: CI checks the format (scripts/setup.sh installs it)" >&2
  exit 1
else
  echo "format check skipped: clang-format is not installed here"
fi

for dir in "${variants[@]}"; do
  echo "== CPU tests ($dir)"
  if [ -x "$dir/tests/epx_cpu_tests" ]; then
    "$dir/tests/epx_cpu_tests" --gtest_brief=1
  elif [ -n "${CI:-}" ]; then
    echo "CPU tests were not built (GoogleTest missing)" >&2
    exit 1
  else
    echo "CPU tests skipped: GoogleTest is not installed here (the GPU machines have none)"
  fi
  if [ -f python/tests/run.sh ]; then
    echo "== Python tests ($dir)"
    EPX_LIBRARY="$PWD/$dir/libepx.so" bash python/tests/run.sh
  fi
done

echo "== C ABI fuzzer, ASan + UBSan ($BUILD_DIR-sanitize)"; scripts/fuzz.sh "$BUILD_DIR-sanitize" 2000

echo "== Install + C++ example ($BUILD_DIR)"; scripts/check-install.sh "$BUILD_DIR"

echo "== GPU tests"
"$BUILD_DIR/tests/epx_gpu_tests"
