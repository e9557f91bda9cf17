#!/usr/bin/env bash
# Sets up, builds and runs the benchmark on all local GPUs (intranode mode; pass other epx-bench arguments
# to change it). On a machine without GPUs it says so.
#   scripts/bench.sh [intranode|low-latency] [epx-bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD_DIR=${EPX_BUILD_DIR:-build}
scripts/setup.sh "$BUILD_DIR" >/dev/null
mode=${1:-intranode}
[ $# -gt 0 ] && shift
set +e
"$BUILD_DIR/tools/bench/epx-bench" "$mode" "$@"
rc=$?
set -e
if [ $rc -eq 3 ]; then exit 0; fi  # no GPU here: epx-bench said so
exit $rc
