#!/usr/bin/env bash
# The GPU-machine checks still owed by the open issues, in one device call (~480 s), from the repo root:
#   48  constrained decoding under load after the batched masks (bench/device/constrained_step.py, bench serve x2)
#   45  DeepSeek Sparse Attention decode through CUDA graphs (GPU tests; bench/device/dsa_graph.py graph vs eager)
#   49  the Transformers backend on the GPU with the oldest transformers accepted (5.7) beside the machine's own
#   51  a capped long-prompt run (bench e2e --gpu-memory 24GiB)
# Usage: bash bench/device/open_checks.sh WHEELS_DIR [T57_WHEELS_DIR]
#   WHEELS_DIR: xgrammar and apache_tvm_ffi wheels (cp312 manylinux; the machine has no network);
#   T57_WHEELS_DIR: transformers 5.7.0's wheel (its other requirements are the machine's own).
set -u
T0=$(date +%s)
W=${1:?wheels dir}
T57=${2:-}
OUT=${OUT:-./out}
mkdir -p "$OUT"
left() { echo $((480 - ($(date +%s) - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"/*.whl >/dev/null 2>&1
[ -n "$T57" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site57 "$T57"/*.whl \
  >/dev/null 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || tail -20 "$OUT/build.log"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== GPU tests: batched masks, DSA graphs (left $(left) s)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_grammar.py tests/engine/test_sampling.py | tail -2
timeout 90 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/models/test_deepseek_v32.py 2>&1 |
  grep -E "graph~eager|GPU~transformers|passed|failed|^E " | head -12
echo "== constrained step, built-in model (left $(left) s)"
timeout 50 python3 bench/device/constrained_step.py cuda 2>&1 | grep -v "^hetmoe\|USDT" | head -60
echo "== serve, built-in model (left $(left) s)"
timeout 75 hetmoe bench serve --device cuda --clients 16 --constrained 4 --duration 15 --max-tokens 64 \
  --json "$OUT/serve-builtin.json" 2>&1 | tail -7
L=$(left); echo "== serve, qwen3 shape 8 layers (left $L s)"
[ "$L" -gt 60 ] && timeout $((L < 110 ? L : 110)) hetmoe bench serve --device cuda --shape qwen3-30b-a3b --layers 8 \
  --experts-format int4 --expert-cache off --clients 16 --constrained 4 --duration 15 --max-tokens 64 \
  --json "$OUT/serve-qwen3-8l.json" 2>&1 | tail -7
L=$(left); echo "== DSA decode graph vs eager (left $L s)"
[ "$L" -gt 60 ] && timeout $((L < 100 ? L : 100)) python3 bench/device/dsa_graph.py 4 32 2>&1 | grep -v "^hetmoe" | tail -8
if [ -n "$T57" ]; then
  L=$(left); echo "== tests/transformers with transformers 5.7 on the GPU (left $L s)"
  [ "$L" -gt 40 ] && PYTHONPATH=/tmp/site57:/tmp/site timeout $((L < 80 ? L : 80)) \
    python3 -m pytest -q -p no:cacheprovider tests/transformers 2>&1 | tail -4
  PYTHONPATH=/tmp/site57:/tmp/site python3 -c "import transformers; print('transformers', transformers.__version__)"
fi
L=$(left); echo "== e2e deepseek-v3 4 layers under a 24 GiB cap (left $L s)"
[ "$L" -gt 40 ] && timeout "$L" hetmoe bench e2e --shape deepseek-v3 --layers 4 --experts-format int4 --device cuda \
  --expert-cache off --gpu-memory 24GiB --gpu-prefill auto --prompt-tokens 2048,8192 --decode-tokens 8 --repeats 1 \
  --no-variants --json "$OUT/e2e-ds3-4l-cap24.json" 2>&1 | tail -25
echo "== done at $(($(date +%s) - T0)) s"
