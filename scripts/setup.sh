#!/usr/bin/env bash
# Installs what the build needs when it is missing (Debian packages, PyPI), then configures and builds epx.
# Uses what is already installed; on machines without network (the GPU machines) it installs nothing.
#   scripts/setup.sh [BUILD_DIR]      (default: build)
# NVSHMEM (the internode mode needs it; the low-latency mode can use it) is used wherever it is found: in
# EPX_NVSHMEM_DIR, .nvshmem/ of an earlier run, python3's site-packages or the GPU machines' torch venv; else it is
# installed into .nvshmem/ from PyPI (nvidia-nvshmem-cu13, the GPU machines' version) when the network allows, and
# the build goes without it when that fails. EPX_NVSHMEM=0 builds without it; EPX_NVSHMEM=1 fails unless it is
# found or installed.
# Last, the Python for the tests: scripts/python-env.sh (.venv/ with torch and pytest, unless a Python with both is
# already there, as on the GPU machines); EPX_PYTHON_ENV=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v clang-format >/dev/null 2>&1 || need_apt+=(clang-format)  # scripts/format.sh --check (CI)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then need_apt+=(libgtest-dev); fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null ||
      echo "setup: could not install ${need_apt[*]} (no network?); continuing with what is here"
  else
    echo "setup: missing ${need_apt[*]} and cannot apt-get; continuing with what is here"
  fi
fi

if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
command -v nvcc >/dev/null 2>&1 || { echo "setup: nvcc (CUDA 13) not found: install the CUDA toolkit" >&2; exit 1; }

NVSHMEM_PIP=nvidia-nvshmem-cu13==3.4.5  # the version the GPU machines have
nvshmem_usable() { [ -n "$1" ] && [ -f "$1/include/nvshmem.h" ] && [ -f "$1/lib/libnvshmem_device.a" ]; }
find_nvshmem() {
  local from_python=""
  # The pip package is a namespace package (no __init__.py): ask for its search location.
  local probe="import importlib.util as u; s = u.find_spec('nvidia.nvshmem')
print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
  command -v python3 >/dev/null 2>&1 && from_python=$(python3 -c "$probe" 2>/dev/null || true)
  for d in "${EPX_NVSHMEM_DIR:-}" "$PWD/.nvshmem/nvidia/nvshmem" "$from_python" \
           /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem; do
    if nvshmem_usable "$d"; then echo "$d"; return 0; fi
  done
  return 1
}
nvshmem_dir=""
case "${EPX_NVSHMEM:-auto}" in
  0|off|OFF) ;;
  *)
    nvshmem_dir=$(find_nvshmem || true)
    if [ -z "$nvshmem_dir" ] && command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
      echo "setup: installing $NVSHMEM_PIP into .nvshmem/"
      timeout 600 python3 -m pip install --quiet --disable-pip-version-check --target .nvshmem "$NVSHMEM_PIP" \
        >/dev/null 2>&1 || echo "setup: could not install $NVSHMEM_PIP (no network?); building without NVSHMEM"
      nvshmem_dir=$(find_nvshmem || true)
    fi
    if [ -z "$nvshmem_dir" ] && [ "${EPX_NVSHMEM:-auto}" = 1 ]; then
      echo "setup: EPX_NVSHMEM=1 but NVSHMEM was not found (set EPX_NVSHMEM_DIR)" >&2
      exit 1
    fi ;;
esac
if [ -n "$nvshmem_dir" ]; then
  echo "setup: NVSHMEM at $nvshmem_dir"
  nvshmem_mode=ON
  nvshmem_flags=(-DEPX_NVSHMEM=ON "-DEPX_NVSHMEM_DIR=$nvshmem_dir")
else
  nvshmem_mode=OFF
  echo "setup: building without NVSHMEM (no internode mode; the low-latency mode uses the CUDA IPC buffer)"
  nvshmem_flags=(-DEPX_NVSHMEM=OFF -DEPX_NVSHMEM_DIR=)
fi

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
jobs=$(nproc 2>/dev/null || echo 2)
# A build folder configured elsewhere (copied or moved here) cannot be reused: start it again.
if [ -f "$BUILD_DIR/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" "$BUILD_DIR/CMakeCache.txt"; then
  echo "setup: $BUILD_DIR was configured for another source folder; configuring it again"
  rm -rf "$BUILD_DIR"
fi
configure() {
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${nvshmem_flags[@]}" >/dev/null
}
# A build folder configured with another NVSHMEM choice is configured again (the cache keeps the rest).
if [ -f "$BUILD_DIR/CMakeCache.txt" ] &&
   { ! grep -qx "EPX_NVSHMEM:STRING=$nvshmem_mode" "$BUILD_DIR/CMakeCache.txt" ||
     ! grep -qx "EPX_NVSHMEM_DIR:PATH=$nvshmem_dir" "$BUILD_DIR/CMakeCache.txt"; }; then
  echo "setup: $BUILD_DIR was configured with another NVSHMEM choice; configuring it again"
  cmake -S . -B "$BUILD_DIR" "${nvshmem_flags[@]}" >/dev/null
fi
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  configure
  cmake --build "$BUILD_DIR" -j "$jobs"
elif ! cmake --build "$BUILD_DIR" -j "$jobs"; then
  # Configured on another machine (tools at other paths): configure again from scratch, once.
  echo "setup: the existing $BUILD_DIR does not build here; configuring it again"
  rm -rf "$BUILD_DIR"
  configure
  cmake --build "$BUILD_DIR" -j "$jobs"
fi

# The Python for the tests (torch and pytest): .venv/, or one that has both already (scripts/python-env.sh).
# EPX_PYTHON_ENV=0 skips it.
if [ "${EPX_PYTHON_ENV:-1}" != 0 ]; then
  py=$(bash scripts/python-env.sh | tail -n 1) && echo "setup: Python for the tests: $py" ||
    echo "setup: no Python with torch and pytest could be set up (the Python tests skip what needs them; CI fails)"
fi
