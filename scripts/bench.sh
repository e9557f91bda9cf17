#!/usr/bin/env bash
# Sets up, builds and runs the benchmark on all local GPUs (intranode mode by default; pass another mode and
# epx-bench options to change it). On a machine without GPUs it says so.
#   scripts/bench.sh [intranode|internode|low-latency] [epx-bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${EPX_BUILD_DIR:-build}
EPX_PYTHON_ENV=0 scripts/setup.sh "$BUILD_DIR" >/dev/null  # the benchmark needs no Python test environment
mode=${1:-intranode}
[ $# -gt 0 ] && shift
set +e
"$BUILD_DIR/tools/bench/epx-bench" "$mode" "$@"
rc=$?
set -e
if [ $rc -eq 3 ]; then exit 0; fi  # no GPU here: epx-bench said so
exit $rc
