#!/usr/bin/env bash
# Local-memory traffic of one device function in a compiled object: spilled registers are stored to and reloaded from
# local memory (STL / LDL), which at 1024 threads a block does not fit in L1 and is reloaded from L2. Counts the
# function's STL, LDL, 128-bit global loads and instructions, from the first line matching FROM on (default: all).
#   tools/probes/sass_local.sh OBJECT FUNCTION_SUBSTRING [FROM_REGEX]
#   tools/probes/sass_local.sh OBJECT --all     (every function of the object: LDL, STL, instructions, name)
# e.g. the low-latency dispatch receive's item loop (peer-pointer build, no rank masking, with the top-k):
#   tools/probes/sass_local.sh build/CMakeFiles/epx.dir/src/kernels/low_latency/dispatch.cu.o \
#     'receive_phaseILb0ELb1E' 'BAR.SYNC.DEFER_BLOCKING 0x1'
# Needs cuobjdump and nvdisasm (CUDA's bin folder) on PATH. Static counts: a loop's body counts once.
set -euo pipefail
obj=$1 fun=$2 from=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && cuobjdump -xelf all "$(realpath "$obj")" >/dev/null)
# Demangled, without the per-file prefixes ("_INTERNAL_<hash>::", "epx::(anonymous namespace)::"); raw without c++filt.
short_names() { if command -v c++filt >/dev/null; then c++filt; else cat; fi |
  sed -E 's/_INTERNAL_[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+:://g; s/epx::\(anonymous namespace\):://g'; }
for cubin in "$work"/*.cubin; do
  nvdisasm -c "$cubin" >"$work/all.sass"
  if [ "$fun" = "--all" ]; then
    # A device function called by a kernel is named "$<kernel>$<function>": the name is the part after the last "$".
    awk '/\.type.*@function/ { name = $2; sub(/,.*/, "", name); n = split(name, part, "$"); name = part[n]
                                if (!(name in seen)) { seen[name] = 1; order[++k] = name } }
         name != "" && /LDL/ { ldl[name]++ }
         name != "" && /STL/ { stl[name]++ }
         name != "" && /\/\*[0-9a-f]*\*\/ / { ins[name]++ }
         END { for (i = 1; i <= k; ++i) { f = order[i]; printf "LDL %4d  STL %4d  instructions %6d  %s\n", ldl[f], stl[f], ins[f], f } }' \
      "$work/all.sass" | short_names | sed "s|^|$(basename "$cubin") |"
    continue
  fi
  # The function's block: from its .type line to the next function's.
  awk -v f="$fun" '/\.type.*@function/ { inside = index($0, f) > 0 } inside' "$work/all.sass" >"$work/fun.sass"
  [ -s "$work/fun.sass" ] || continue
  if [ -n "$from" ]; then
    awk -v r="$from" 'on || $0 ~ r { on = 1; print }' "$work/fun.sass" >"$work/part.sass"
  else
    cp "$work/fun.sass" "$work/part.sass"
  fi
  echo "$(basename "$cubin") $fun: LDL $(grep -c 'LDL' "$work/part.sass" || true)" \
    "STL $(grep -c 'STL' "$work/part.sass" || true) LDG.E.128 $(grep -c 'LDG.E.128' "$work/part.sass" || true)" \
    "instructions $(grep -c '/\*[0-9a-f]*\*/ ' "$work/part.sass" || true)"
done
