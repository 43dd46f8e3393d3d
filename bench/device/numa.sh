#!/usr/bin/env bash
# Issue 6 item 4 on the GPU machine (16 cores, one NUMA node): NUMA tensor parallelism forced to 2 subpools.
# Run from the repo root after `python3 -m pip install --no-build-isolation --no-deps -e .`. Everything lands in
# $OUT/numa/. Budget: ~2 min (hard stops at ~2.7 min).
#   1. hetmoe doctor --numa auto and --numa 2 (topology, the subpools and where memory goes)
#   2. tests/cpu/test_numa.py with the AVX-512 row-block kernels and the native AMX path (the loader end-to-end test
#      is pure Python plumbing, run on the dev machine)
#   3. python -m hetmoe.bench.numa: DeepSeek-V3 layer (H 7168, I 2048, 64 experts, top-8), 16 threads as one
#      pool vs 2 subpools of 8, decode (T = 1, 4, 32) and prefill (T = 512, 2048 int8), int8 / bf16 / int4:
#      ms, GB/s, % of STREAM, TFLOPS, overhead of the split; one node, so it shows the cost of TP, no gain.
set -uo pipefail
out="${OUT:-./out}/numa"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
SECONDS=0
git rev-parse --short HEAD 2>/dev/null | tee "$out/commit.txt"
grep -m1 "model name" /proc/cpuinfo | tee "$out/cpu.txt"
cat /sys/devices/system/node/online /sys/devices/system/node/has_memory 2>&1 | tee "$out/nodes.txt"

# 1) doctor
{ timeout 20 python3 -m hetmoe doctor --numa auto; echo "---- --numa 2"; timeout 20 python3 -m hetmoe doctor --numa 2; } \
  >"$out/doctor.txt" 2>&1
grep -E "^numa|^  (node|engine|subpool)" "$out/doctor.txt"

# 2) tests
timeout 70 python3 -m pytest -q -rs -s -p no:cacheprovider tests/cpu/test_numa.py -k "not loader_numa" \
  --junitxml="$out/junit.xml" >"$out/tests.txt" 2>&1
echo "tests rc=$? after ${SECONDS}s" | tee -a "$out/tests.txt"
grep -E "passed|failed|Error|assert|SKIPPED|unsplit engine" "$out/tests.txt" | tail -40

# 3) benchmark, stopped by its own budget (it writes its JSON after every point)
t=$(( 150 - SECONDS ))
if [ "$t" -lt 30 ]; then t=30; fi
timeout "$t" python3 -m hetmoe.bench.numa --shape deepseek-v3 --experts 64 --threads 16 --subpools 2 \
  --formats int8,bf16,int4 --tokens 1,4,32,512,2048 --repeats 5 --budget-s $(( t - 25 )) \
  --json "$out/bench.json" >"$out/bench.txt" 2>&1
echo "bench rc=$? after ${SECONDS}s" | tee -a "$out/bench.txt"
cat "$out/bench.txt"
echo "done in ${SECONDS}s"
