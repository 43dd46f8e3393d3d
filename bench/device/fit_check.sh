#!/usr/bin/env bash
# Issue 24's placement targets in one run on the GPU machine: the plan for the full deepseek-v3 shape under a
# 24 GiB card, deepseek-v3 layers generating under a VRAM budget (peak allocation printed beside it), the GPU part
# of a qwen3-30b-a3b decode step per dense format, and --gpu-experts auto under 24 GiB against none.
# Usage: bash bench/device/fit_check.sh [all|dsv3|qwen3] [dsv3-layers] [qwen3-layers]   results under $OUT (or ./out)
set -uo pipefail
out=${OUT:-./out}
mkdir -p "$out"
part=${1:-all}
dsv3_layers=${2:-16}
qwen_layers=${3:-48}
export PYTHONUNBUFFERED=1
e2e() { local name=$1; shift; timeout 420 hetmoe bench e2e --json "$out/$name.json" "$@" 2>"$out/$name.err" \
  | tee "$out/$name.txt" | grep -E "GPU peak|^hybrid|^ *graph|gpu|budget|STREAM read \(" ; tail -3 "$out/$name.err"; }

if [ "$part" != qwen3 ]; then
hetmoe plan --shape deepseek-v3 --device cuda --gpu-memory 24GiB --max-context 32768 --cpu-memory 512GiB \
  2>&1 | tee "$out/plan-dsv3-24g.txt" | tail -25
# deepseek-v3: as many layers as RAM holds under a 24 GiB budget (auto dense format), and 6 layers under a budget
# their bf16 dense part exceeds
for run in "24GiB $dsv3_layers" "8GiB 6"; do
  set -- $run
  e2e "dsv3-${2}l-$1" --shape deepseek-v3 --layers "$2" --device cuda --gpu-memory "$1" --dense-format auto \
    --experts-format int4 --max-context 32768 --prompt-tokens 128 --decode-tokens 32 --repeats 1 --variants graph
done
fi
[ "$part" = dsv3 ] && exit 0
# qwen3-30b-a3b: GPU part of the graph step per dense format (GPU experts off)
for fmt in bf16 fp8 int4; do
  e2e "qwen3-${qwen_layers}l-dense-$fmt" --shape qwen3-30b-a3b --layers "$qwen_layers" --device cuda \
    --dense-format "$fmt" --experts-format int4 --prompt-tokens 128 --decode-tokens 48 --repeats 2 --variants graph
done
# --gpu-experts auto under 24 GiB against none, one build (variants graph = none, graph+gpu = the planned experts)
e2e "qwen3-${qwen_layers}l-gpu-experts-auto-24g" --shape qwen3-30b-a3b --layers "$qwen_layers" --device cuda \
  --gpu-memory 24GiB --gpu-experts auto --dense-format auto --experts-format int4 --prompt-tokens 128 \
  --decode-tokens 48 --repeats 2 --variants graph,graph+gpu
