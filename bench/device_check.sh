#!/usr/bin/env bash
# One batched run on the lent GPU machine (no network): build, test, benchmark; results under $OUT (or ./out).
# Usage: bash bench/device_check.sh [shapes] [--no-tests]
set -uo pipefail
out=${OUT:-./out}
mkdir -p "$out"
shapes=${1:-deepseek-v3,qwen3-30b-a3b}
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
hetmoe doctor 2>&1 | tee "$out/doctor.txt"
if [ "${2:-}" != "--no-tests" ]; then
  timeout 240 python3 -m pytest -q -x tests 2>&1 | tee "$out/tests.txt" | tail -5
fi
timeout 60 hetmoe bench overhead 2>&1 | tee "$out/overhead.txt"
hetmoe bench kernel --shapes "$shapes" --json "$out/kernel.json" 2>&1 | tee "$out/kernel.txt" | grep -vE '^\s*(load|loading)'
