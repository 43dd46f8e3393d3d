#!/usr/bin/env bash
# Model-runner checks on the lent GPU machine (no network): build, the whole test suite (GPU tests included),
# generate with the built-in model on both placements, then (optionally) the end-to-end benchmark.
# Usage: bash bench/device_runner.sh [bench-e2e-args...]   results under $OUT (or ./out)
set -uo pipefail
out=${OUT:-./out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HETMOE_TEST_TMP="$out"
python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q tests -rs 2>&1 | tee "$out/tests.txt" | tail -8
  python3 -m pytest -q tests/engine/test_hybrid_gpu.py -s 2>&1 | grep -E "rel. logit error|passed|failed" | tee "$out/hybrid.txt"
fi
for dev in cuda cpu; do
  hetmoe generate --device $dev --expert-cache off --max-tokens 64 --json 2>"$out/gen_$dev.err" | tee "$out/gen_$dev.json"
  tail -2 "$out/gen_$dev.err"
done
if [ $# -gt 0 ]; then
  hetmoe bench e2e "$@" --json "$out/e2e.json" 2>&1 | tee "$out/e2e.txt"
fi
