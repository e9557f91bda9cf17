#!/usr/bin/env bash
# Sets up, builds and runs every test this machine can run: the CPU tests always; the GPU suite on all local
# GPUs when there are at least two; the Python binding tests when python3 is there.
#   scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${EPX_BUILD_DIR:-build}
scripts/setup.sh "$BUILD_DIR"

echo "== Format"
if command -v clang-format >/dev/null 2>&1; then
  scripts/format.sh --check
elif [ -n "${CI:-}" ]; then
  echo "clang-format is missing: CI checks the format (scripts/setup.sh installs it)" >&2
  exit 1
else
  echo "format check skipped: clang-format is not installed here"
fi

echo "== CPU tests"
if [ -x "$BUILD_DIR/tests/epx_cpu_tests" ]; then
  "$BUILD_DIR/tests/epx_cpu_tests" --gtest_brief=1
elif [ -n "${CI:-}" ]; then
  echo "CPU tests were not built (GoogleTest missing)" >&2
  exit 1
else
  echo "CPU tests skipped: GoogleTest is not installed here (the GPU machines have none)"
fi

if [ -f python/tests/run.sh ]; then
  echo "== Python tests"
  EPX_LIBRARY="$PWD/$BUILD_DIR/libepx.so" bash python/tests/run.sh
fi

echo "== GPU tests"
"$BUILD_DIR/tests/epx_gpu_tests"
