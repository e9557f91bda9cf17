#!/usr/bin/env bash
# Installs a configured and built epx folder into a temporary prefix, checks what the prefix holds, builds
# examples/cpp against it with find_package(epx) and runs the example: on every local GPU where there are any (it
# fails unless every rank passes), else it only loads libepx.so and says that there is no GPU. Exit status nonzero
# on any failure.
#   scripts/check-install.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] && [ -f "$1/CMakeCache.txt" ] || { echo "usage: $0 BUILD_DIR (a configured, built epx folder)" >&2; exit 2; }
BUILD_DIR=$1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epx-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$BUILD_DIR" --prefix "$prefix" >/dev/null
for f in include/epx/epx.h include/epx/epx.hpp include/epx/launcher.hpp lib/libepx.so \
         lib/cmake/epx/epxConfig.cmake lib/cmake/epx/epxConfigVersion.cmake lib/cmake/epx/epxTargets.cmake; do
  [ -e "$prefix/$f" ] || { echo "check-install: $f is missing from the installed prefix" >&2; exit 1; }
done
if grep -qx "EPX_BUILD_TOOLS:BOOL=ON" "$BUILD_DIR/CMakeCache.txt" && [ ! -x "$prefix/bin/epx-bench" ]; then
  echo "check-install: bin/epx-bench is missing from the installed prefix" >&2
  exit 1
fi

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cmake -S examples/cpp -B "$tmp/example" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  >/dev/null
cmake --build "$tmp/example" >/dev/null
"$tmp/example/epx_example"
echo "check-install: installed $BUILD_DIR, built examples/cpp against it with find_package(epx) and ran it"
