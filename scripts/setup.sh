#!/usr/bin/env bash
# Installs what the build needs when it is missing (Debian packages, PyPI), then configures and builds epx.
# Uses what is already installed; on machines without network (the GPU machines) it installs nothing.
#   scripts/setup.sh [BUILD_DIR]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
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

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
jobs=$(nproc 2>/dev/null || echo 2)
# A build folder configured elsewhere (copied or moved here) cannot be reused: start it again.
if [ -f "$BUILD_DIR/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" "$BUILD_DIR/CMakeCache.txt"; then
  echo "setup: $BUILD_DIR was configured for another source folder; configuring it again"
  rm -rf "$BUILD_DIR"
fi
configure() { cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null; }
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
