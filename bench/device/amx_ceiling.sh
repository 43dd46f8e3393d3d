#!/usr/bin/env bash
# The AMX prefill job's stages on the GPU machine's Xeon (deepseek-v3 layer): at T=2048 over 8 experts (every expert
# gets all 2048 tokens: the weights are reused 2048 times, so this is the kernels' compute ceiling) and at T=512 over
# 64 experts (the point), int8 with group 128 and per-row scales, bf16, int4. Output: $OUT/amx/.
set -uo pipefail
out="${OUT:-./out}/amx"
mkdir -p "$out"
SECONDS=0
kb() {
  timeout 100 hetmoe bench kernel --shapes deepseek-v3 --random-packed --no-baseline --profile --repeats 3 --warmup 1 "$@" \
    2>&1 | grep -E "^STREAM|^deepseek|stages|rror"
}
for g in 128 0; do kb --formats int8 --group-size $g --tokens 2048 --experts 8; done | tee "$out/ceiling.txt"
kb --formats bf16 --tokens 2048 --experts 8 | tee -a "$out/ceiling.txt"
kb --formats int8 --group-size 0 --tokens 512 --experts 64 | tee "$out/t512.txt"
kb --formats int8,bf16 --tokens 512 --experts 64 | tee -a "$out/t512.txt"
echo "amx total ${SECONDS}s"
