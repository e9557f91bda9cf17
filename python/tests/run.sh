#!/usr/bin/env bash
# Runs the Python package's tests (tests/python) from the source tree, against $EPX_LIBRARY or the newest
# build*/libepx.so. scripts/test.sh calls it. Missing pieces skip with a message instead of failing:
# no python3, no pytest (and no way to install it), no torch (the validation and GPU tests skip), fewer
# than 2 GPUs (the multi-GPU tests skip). Test failures do fail.
#   python/tests/run.sh [pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "python tests: skipped ($PY not found)"
  exit 0
fi
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "python tests: pytest missing, trying pip install pytest"
  if ! timeout 300 "$PY" -m pip install -q pytest >/dev/null 2>&1 || ! "$PY" -c "import pytest" >/dev/null 2>&1; then
    echo "python tests: skipped (pytest is not installed and could not be installed)"
    exit 0
  fi
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "python tests: torch not installed: only the ctypes binding tests run"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m pytest -q -p no:cacheprovider tests/python "$@"
