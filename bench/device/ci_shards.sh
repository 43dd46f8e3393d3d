#!/usr/bin/env bash
# The per-commit tier (the README's test command: tests marked slow skipped) on the lent GPU machine's AMX CPU, the
# GPU hidden as on a CI machine: the test files in 4 (or N) shards of about equal size, each shard's pytest pinned
# to 4 of the 16 cores (OMP_NUM_THREADS=4; the expert pools take the cores they may run on), so that no two shards'
# pinned pools share a core. Results under $OUT (or ./out): shardK.log, rc.txt; a summary on stdout.
#
# Usage: bash bench/device/ci_shards.sh [timeout seconds per shard, default 300] [shards, default 4]
# The machine has no network: the test extras it lacks (openai, anthropic, gguf, xgrammar, compressed-tensors, a
# transformers >= 5.7 and what they need) travel as wheels; install them first, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -uo pipefail
out=${OUT:-./out}
mkdir -p "$out"
T=${1:-300}
N=${2:-4}
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
CUDA_VISIBLE_DEVICES= python3 -m hetmoe doctor --threads 1 | sed -n 1,3p
N=$N python3 - >"$out/shards.txt" <<'PY'
import glob, os
files = sorted(glob.glob("tests/**/test_*.py", recursive=True), key=lambda f: -os.path.getsize(f))
shards = [[0, []] for _ in range(int(os.environ["N"]))]
for f in files:  # largest first, each to the lightest shard
    s = min(shards, key=lambda x: x[0])
    s[0] += os.path.getsize(f)
    s[1].append(f)
for s in shards:
    print(" ".join(s[1]))
PY
t0=$(date +%s)
k=0
rm -f "$out/rc.txt"
while read -r files; do
  # shellcheck disable=SC2086  # the file list splits into arguments
  (taskset -c $((4 * k))-$((4 * k + 3)) env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 timeout "$T" \
    python3 -m pytest -q -p no:cacheprovider --durations=5 $files >"$out/shard$k.log" 2>&1
   echo "shard $k rc $?" >>"$out/rc.txt") &
  k=$((k + 1))
done <"$out/shards.txt"
wait
echo "shards done in $(($(date +%s) - t0)) s"
cat "$out/rc.txt"
for k in $(seq 0 $((N - 1))); do
  tail -1 "$out/shard$k.log"
  grep -E "^(FAILED|ERROR)" "$out/shard$k.log" | head -20
done
