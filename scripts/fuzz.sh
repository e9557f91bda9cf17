#!/usr/bin/env bash
# The C ABI fuzzer (tests/cpu/capi_fuzz.cpp) under AddressSanitizer and UBSan, for a bounded number of cases.
# Configures BUILD_DIR with -DEPX_SANITIZE=ON and builds only what the fuzzer links (libepx, the reference model,
# epx_capi_fuzz): no NVSHMEM, no tools, and the CUDA sources as PTX only (the fuzzer launches no kernel; their host
# side is still instrumented, through nvcc's -Xcompiler). Then runs the cases; prints the table of entry points,
# cases and statuses; fails on any broken rule, sanitizer report or leak. scripts/test.sh runs it with the defaults
# (about a minute on 2 cores with the build, a few seconds after).
#   scripts/fuzz.sh [BUILD_DIR] [CASES] [SEED]     (defaults: build-sanitize, 2000, 30)
#   scripts/fuzz.sh build-sanitize 1 7 --first 123   (extra arguments go to epx_capi_fuzz: here, case 123 alone)
# Sanitizer settings (set here unless already set):
#   ASAN_OPTIONS=protect_shadow_gap=0  the CUDA runtime maps memory where ASan keeps its shadow gap; without this,
#                                      CUDA calls of an instrumented process fail on a GPU machine
#   ASAN_OPTIONS=detect_leaks=1        leaks fail the run (nothing of the fuzzer's path allocates in the driver:
#                                      buffer creation fails before the device is touched, or has no device)
#   UBSAN_OPTIONS=print_stacktrace=1   with -fno-sanitize-recover=all the first undefined behaviour ends the run;
#                                      the case that ran last is printed from the fuzzer's --trace file
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build-sanitize}
CASES=${2:-2000}
SEED=${3:-30}
shift $(($# < 3 ? $# : 3))
export ASAN_OPTIONS=${ASAN_OPTIONS:-protect_shadow_gap=0:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if [ -f "$BUILD_DIR/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" "$BUILD_DIR/CMakeCache.txt"; then
  rm -rf "$BUILD_DIR"  # configured for another source folder
fi
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DEPX_SANITIZE=ON -DEPX_NVSHMEM=OFF \
    -DEPX_BUILD_TOOLS=OFF -DCMAKE_CUDA_ARCHITECTURES=90-virtual >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc 2>/dev/null || echo 2)" --target epx_capi_fuzz
trace="$BUILD_DIR/capi_fuzz.last_case"
if ! "$BUILD_DIR/tests/epx_capi_fuzz" --cases "$CASES" --seed "$SEED" --trace "$trace" "$@"; then
  echo "fuzz: failed; the case that ran last: $(cat "$trace" 2>/dev/null || echo unknown)" >&2
  exit 1
fi
