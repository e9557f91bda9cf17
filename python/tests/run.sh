#!/usr/bin/env bash
# Runs the Python package's tests (tests/python) from the source tree, against $EPX_LIBRARY or the newest
# build*/libepx.so. scripts/test.sh calls it. The interpreter is $PYTHON, else the one scripts/python-env.sh gives
# (it imports torch and pytest: .venv/, the GPU machines' /opt/torch/.venv, or python3; it sets up .venv/ when none
# does). Outside CI, missing pieces skip with a message: no python3 or pytest (nothing is run), no torch (the
# validation and GPU tests skip). In CI (CI set) each of them is an error. Fewer than 2 GPUs: the multi-GPU tests
# skip. Test failures do fail.
#   python/tests/run.sh [pytest arguments]   (test files or folders among them: only those run)
set -uo pipefail
cd "$(dirname "$0")/../.."
missing() {  # missing WHAT: fails in CI, skips elsewhere
  if [ -n "${CI:-}" ]; then
    echo "python tests: $1; CI runs every Python test (scripts/setup.sh sets up .venv with torch and pytest)" >&2
    exit 1
  fi
  echo "python tests: $1"
}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  PY=$(bash scripts/python-env.sh | tail -n 1)
  PY=${PY:-python3}
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  missing "$PY not found"
  echo "python tests: skipped"
  exit 0
fi
# One probe: "PYTHON_VERSION HAS_PYTEST TORCH_VERSION_OR_-".
probe='import importlib.util, sys
try:
    import torch
    t = torch.__version__
except Exception:
    t = "-"
print(sys.version.split()[0], int(importlib.util.find_spec("pytest") is not None), t)'
read -r py_version has_pytest torch_version < <("$PY" -c "$probe" 2>/dev/null || echo "? 0 -")
if [ "$has_pytest" != 1 ]; then
  missing "pytest is not installed in $PY"
  echo "python tests: skipped"
  exit 0
fi
if [ "$torch_version" = - ]; then
  missing "torch is not installed in $PY"
  echo "python tests: only the ctypes binding tests run"
fi
echo "python tests: $PY (Python $py_version, torch $torch_version)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# Test files or folders among the arguments (an argument that is neither an option nor an option's value and names
# a path, "::test" ids included) are what runs; without any, the whole of tests/python.
where=tests/python
value=0
for arg in "$@"; do
  if [ $value = 1 ]; then value=0; continue; fi
  case $arg in
    -k | -m | -p | -o | -c | --ignore | --ignore-glob | --deselect | --rootdir | --basetemp | --junitxml) value=1 ;;
    -*) ;;
    *) if [ -e "${arg%%::*}" ]; then where=; fi ;;
  esac
done
exec "$PY" -m pytest -q -p no:cacheprovider $where "$@"
