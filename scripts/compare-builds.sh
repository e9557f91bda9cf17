#!/usr/bin/env bash
# Benchmarks two builds in one call, interleaved (A, B, A, B, ...), so that their numbers come from the same machine
# and time: epx-bench intranode (--sms 24, with NCCL) and epx-bench low-latency, at R ranks. Logs and JSON under
# OUT_DIR; a table of the slowest rank per row (intranode GB/s, low-latency us) last.
#   scripts/compare-builds.sh OUT_DIR BUILD_A BUILD_B [ROUNDS=2] [RANKS=2]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${1:?usage: scripts/compare-builds.sh OUT_DIR BUILD_A BUILD_B [ROUNDS] [RANKS]}
A=${2:?build A}
B=${3:?build B}
ROUNDS=${4:-2}
R=${5:-2}
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for tag in A B; do
    dir=$A; [ $tag = B ] && dir=$B
    timeout 300 "$dir/tools/bench/epx-bench" intranode --gpus "$R" --sms 24 \
      --json "$OUT/intranode-$tag-$round.json" >"$OUT/intranode-$tag-$round.log" 2>&1 || echo "intranode $tag $round failed"
    timeout 300 "$dir/tools/bench/epx-bench" low-latency --gpus "$R" --no-nccl \
      --json "$OUT/ll-$tag-$round.json" >"$OUT/ll-$tag-$round.log" 2>&1 || echo "low-latency $tag $round failed"
  done
done
python3 - "$OUT" "$ROUNDS" "$A" "$B" <<'PY'
import json, os, sys
out, rounds, a, b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def load(path):
    try:
        return json.load(open(path))
    except Exception as e:
        return None
table = {}
for tag in "AB":
    for r in range(1, rounds + 1):
        j = load(f"{out}/intranode-{tag}-{r}.json")
        if j:
            for row in j["rows"]:
                key = f"intranode {row['op']} ({row['impl']}) GB/s"
                table.setdefault(key, {}).setdefault(tag, []).append(min(row["gbps"]))
        j = load(f"{out}/ll-{tag}-{r}.json")
        if j:
            for row in j["rows"]:
                key = f"low-latency {row['op']} us"
                table.setdefault(key, {}).setdefault(tag, []).append(max(row["median_us"]))
print(f"A = {a}, B = {b}; slowest rank per run, {rounds} rounds interleaved")
print(f"{'row':58s} {'A':>22s} {'B':>22s}  B/A")
for key, v in table.items():
    fa, fb = v.get("A", []), v.get("B", [])
    ratio = ""
    if fa and fb:
        ma, mb = sum(fa) / len(fa), sum(fb) / len(fb)
        ratio = f"{mb / ma:.3f}"
    fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)
    print(f"{key:58s} {fmt(fa):>22s} {fmt(fb):>22s}  {ratio}")
PY
