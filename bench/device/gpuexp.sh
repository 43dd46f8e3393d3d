#!/usr/bin/env bash
# GPU-resident experts (--gpu-experts N, issue 4 item 4) on the GPU machine, about 4 minutes (at most 9.5):
#   1. tests/models/test_gpu_experts{,_routed}.py: CPU tests and the GPU-marked ones (hybrid vs all-CPU placement for
#      qwen3_moe and deepseek_v3, deferral + resident experts vs a CPU emulation, the dense and routed decode paths
#      against references and captured in a CUDA graph)
#   2. `hetmoe generate --gpu-experts 4` on the built-in model (the calibration report on stderr)
#   3. the decode paths alone on the qwen3-30b-a3b expert shape (bench/device/gpu_experts.py): dense vs routed, us per
#      layer for N = 4, 16, 38 resident, T = 1, 4, 8; then bf16/int8/int4 resident experts (gpu_experts_int.py)
# Run from the repo root after `python3 -m pip install --no-build-isolation --no-deps -e .`; everything lands in
# $OUT/gpuexp/ (summary.json, tests.log, junit.xml, generate_*.json/err, dense_bench.json).
set -uo pipefail
out="${OUT:-./out}/gpuexp"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
git rev-parse HEAD >"$out/commit.txt" 2>/dev/null

timeout 240 python3 -m pytest tests/moe/gpu_resident/test_gpu_experts.py tests/moe/gpu_resident/test_gpu_experts_routed.py \
  tests/moe/gpu_resident/test_gpu_experts_int.py -q -rs -s -p no:cacheprovider \
  --junitxml="$out/junit.xml" >"$out/tests.log" 2>&1
tests_rc=$?
grep -E "max rel|vs cpu|vs CPU|emulation|all resident|passed|failed|Error|SKIPPED" "$out/tests.log" | tail -40

for n in 4; do
  timeout 40 python3 -m hetmoe generate --device cuda --gpu-experts $n --expert-cache off --max-tokens 24 \
    --raw --json --prompt "def forward(self, x):" >"$out/generate_n$n.json" 2>"$out/generate_n$n.err"
  echo "generate --gpu-experts $n: rc=$? $(head -c 300 "$out/generate_n$n.json")"
  grep -E "GPU experts|ignored|error" "$out/generate_n$n.err" | head -3
done

timeout 150 python3 bench/device/gpu_experts.py --n 4,16,38 --t 1,4,8 --json "$out/dense_bench.json" 2>&1 \
  | tee "$out/dense_bench.txt"

# int8/int4 resident experts against bf16: N = 29 (bf16) and 105 (int4), what auto keeps under 24 GiB
timeout 150 python3 bench/device/gpu_experts_int.py --n 29,105 --t 1,4,8 --json "$out/int_bench.json" 2>&1 \
  | tee "$out/int_bench.txt"

python3 - "$out" "$tests_rc" "$t0" <<'PY'
import json, re, sys, time, pathlib
out, rc, t0 = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
log = (out / "tests.log").read_text(errors="replace")
last = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed)", l)]
json.dump({"tests_rc": rc, "tests_summary": last[-1] if last else None,
           "measured": [l.strip() for l in log.splitlines() if re.search(r"max rel|vs cpu|emulation|all resident", l)],
           "wall_s": time.time() - t0}, open(out / "summary.json", "w"), indent=1)
print(f"gpuexp: tests rc={rc} ({last[-1] if last else 'no summary'}), {time.time() - t0:.0f} s")
PY
exit $tests_rc
