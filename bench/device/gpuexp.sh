#!/usr/bin/env bash
# GPU-resident experts (--gpu-experts N, issue 4 item 4) on the GPU machine, about 2 minutes (at most 3.5):
#   1. tests/models/test_gpu_experts.py: CPU tests and the GPU-marked ones (hybrid vs all-CPU placement for qwen3_moe and
#      deepseek_v3, deferral + resident experts vs a CPU emulation, the dense path captured in a CUDA graph)
#   2. `hetmoe generate --gpu-experts 4` on the built-in model (the calibration report on stderr)
#   3. the dense (decode) path alone on the qwen3-30b-a3b expert shape: us per layer for N = 4..32 resident, T = 1..8
# Run from the repo root after `python3 -m pip install --no-build-isolation --no-deps -e .`; everything lands in
# $OUT/gpuexp/ (summary.json, tests.log, junit.xml, generate_*.json/err, dense_bench.json).
set -uo pipefail
out="${OUT:-./out}/gpuexp"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
git rev-parse HEAD >"$out/commit.txt" 2>/dev/null

timeout 120 python3 -m pytest tests/models/test_gpu_experts.py -q -rs -s -p no:cacheprovider \
  --junitxml="$out/junit.xml" >"$out/tests.log" 2>&1
tests_rc=$?
grep -E "max rel|vs cpu|vs CPU|emulation|all resident|passed|failed|Error|SKIPPED" "$out/tests.log" | tail -40

for n in 4; do
  timeout 40 python3 -m hetmoe generate --device cuda --gpu-experts $n --expert-cache off --max-new-tokens 24 \
    --raw --json --prompt "def forward(self, x):" >"$out/generate_n$n.json" 2>"$out/generate_n$n.err"
  echo "generate --gpu-experts $n: rc=$? $(head -c 300 "$out/generate_n$n.json")"
  grep -E "GPU experts|ignored|error" "$out/generate_n$n.err" | head -3
done

timeout 40 python3 - "$out/dense_bench.json" <<'PY' 2>&1 | tee "$out/dense_bench.txt"
import json, sys, torch
from hetmoe.moe.gpu_experts import GpuExperts
H, I, E, k = 2048, 768, 128, 8  # qwen3-30b-a3b
res = []
for n in (4, 8, 16, 32):
    g = torch.randn(n, I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    gpu = GpuExperts(list(range(n)), g, g.clone(), g.transpose(1, 2).contiguous(), E, torch.bfloat16, "cuda")
    for T in (1, 4, 8):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda")
        for _ in range(5):
            gpu(x, ids, w)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            gpu(x, ids, w)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            gpu(x, ids, w)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 200
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record(); torch.cuda.synchronize()
        us = a.elapsed_time(b) * 1e3 / reps
        gbps = gpu.nbytes / (us * 1e-6) / 1e9
        res.append({"n": n, "T": T, "us_per_layer_graph": us, "weight_bytes": gpu.nbytes, "hbm_gbps": gbps})
        print(f"N={n:2d} T={T}: {us:7.1f} us per layer (graph replay), {gpu.nbytes / 1e6:6.1f} MB resident, "
              f"{gbps:6.0f} GB/s of weights")
    del gpu, g
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY

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
