#!/usr/bin/env bash
# Formats the C, C++ and CUDA sources with clang-format and the repository's .clang-format.
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   list the files that differ and fail (CI runs this through scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null 2>&1; then
  echo "format: clang-format is not installed (scripts/setup.sh installs it from the Debian packages)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cpp' '*.hpp' '*.cu' '*.cuh' 2>/dev/null ||
                     find include src tests tools examples \( -name '*.c' -o -name '*.h' -o -name '*.cpp' \
                       -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \))
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format --style=file "$f" | cmp -s - "$f" || bad+=("$f")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "format: ${#bad[@]} files differ from .clang-format ($(clang-format --version | head -1)):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    echo "run scripts/format.sh to fix them" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files follow .clang-format"
else
  clang-format --style=file -i "${files[@]}"
fi
