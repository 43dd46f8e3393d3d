#!/usr/bin/env bash
# Where the time of a decode step goes on the GPU machine: the CPU MoE job's stages at T=1 (qwen3-30b-a3b layer,
# int4/int8/bf16, 512 experts so the weights come from DRAM), the GPU part of a hybrid step (kernels per layer,
# graph replay), and the AMX prefill job's stages (deepseek-v3 layer, T=512). Run from the repo root after the
# build; everything goes to $OUT/profile/.
set -uo pipefail
out="${OUT:-./out}/profile"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
SECONDS=0
kb() {  # extra args...
  timeout 90 hetmoe bench kernel --shapes qwen3-30b-a3b --tokens 1 --experts 512 --no-baseline --random-packed \
    --profile --repeats 40 --warmup 5 "$@" 2>&1 | grep -E "^STREAM|^qwen3|stages|rror"
}
echo "== CPU job, T=1 (${SECONDS}s)"
kb --formats int4,int8,bf16 | tee "$out/cpu_t1.txt"
for v in "HETMOE_EXP_PF=1024" "HETMOE_EXP_PF=2048" "HETMOE_EXP_SERIAL=0" "HETMOE_EXP_TPT=4" "HETMOE_EXP_TPT=64"; do
  echo "== $v (${SECONDS}s)"
  env "$v" bash -c "$(declare -f kb); kb --formats int4" | tee -a "$out/cpu_t1_variants.txt"
done
echo "== GPU step (${SECONDS}s)"
timeout 150 python3 bench/device/gpu_step_profile.py 8 2>&1 | tee "$out/gpu_step.txt" | grep -vE "^-|^ *$" | head -45
echo "== AMX T=512 (${SECONDS}s)"
timeout 150 hetmoe bench kernel --shapes deepseek-v3 --formats int8,bf16,int4 --tokens 512 --experts 64 --random-packed \
  --no-baseline --profile --repeats 5 2>&1 | grep -E "^STREAM|^deepseek|stages|AMX|rror" | tee "$out/amx_t512.txt"
echo "total ${SECONDS}s"
