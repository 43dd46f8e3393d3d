"""hetmoe's own 2- and 3-bit experts against llama.cpp's Q2_K / Q3_K on the same model (issue 47): the built-in model
written as GGUF by llama.cpp's converter, its routed experts quantized by llama.cpp's own ``llama-quantize`` (no
importance matrix, everything else kept F32), and the same model's float experts quantized by hetmoe (int3, int2 and
the ``--cpu-memory`` mixes); every configuration scored by ``hetmoe eval`` against the original checkpoint's bf16
experts (``--reference-model``) on the model's held-out text.

    python3 bench/lowbit_vs_llama_quantize.py --llama-cpp VENDOR/llama.cpp --quantize BUILD/bin/llama-quantize \\
        --out /tmp/lowbit --json bench/results/NAME.json

VENDOR/llama.cpp: the llama.cpp tree vendored in the llama-cpp-python source distribution (its converter and gguf-py);
llama-quantize built from it (``cmake -B build -DGGML_NATIVE=OFF && cmake --build build --target llama-quantize``).

The built-in model's config.json has no ``scoring_func`` (Transformers' DeepseekV3Config has none: sigmoid always);
llama.cpp's converter then writes no gating function and llama.cpp would gate it with softmax, which hetmoe refuses. The
copy converted here says ``"scoring_func": "sigmoid"``, as DeepSeek's own config.json does. Its experts' down
projections have 96 columns, not a multiple of the K-quants' 256: llama-quantize falls back to Q4_0 for them (it says
so), so its "Q2_K" and "Q3_K" files hold down_proj at 4.5 bits a weight; the table gives every configuration's mean
bits per expert weight.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bits per weight of each expert matrix (codes + scales as stored): llama.cpp's block types, hetmoe's own formats
LLAMA_BPW = {"q2_k": 2.625, "q3_k": 3.4375, "q4_0": 4.5}
OWN_BPW = {"int2": 2.625, "int3": 3.3125, "int4": 4.625, "int4 g32": 4.5, "int4 g64": 4.25}


def run(cmd: list, both: bool = False) -> str:
    """``cmd``'s stdout (``both``: and its stderr, where llama-quantize says what it falls back to)."""
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr)
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"failed ({out.returncode}): {' '.join(map(str, cmd))}\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr if both else out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (converter, gguf-py)")
    ap.add_argument("--quantize", type=Path, required=True, help="llama-quantize built from that tree")
    ap.add_argument("--out", type=Path, required=True, help="working folder (model copy, GGUF files, reports)")
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--budgets", default="468.6MiB,468.8MiB",
                    help="--cpu-memory values for hetmoe's auto mixes (for the built-in model at --window 512)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from hetmoe.engine.llm import default_model_path

    model = args.out / "model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(default_model_path(), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["scoring_func"] = "sigmoid"
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    text = model / "heldout.txt"
    f32 = args.out / "model-f32.gguf"
    run([sys.executable, ROOT / "tests" / "llama_cpp_convert.py", args.llama_cpp, model, "--outfile", f32,
         "--outtype", "f32"])
    files = {}
    for t in ("q2_k", "q3_k"):
        files[t] = args.out / f"model-{t}.gguf"
        log = run([args.quantize, "--tensor-type", "attn_.*=f32", "--tensor-type", "shexp=f32", "--tensor-type",
                   r"ffn_(gate|up|down)\.weight=f32", "--tensor-type", "ffn_gate_inp=f32", "--tensor-type",
                   f"exps={t}", "--output-tensor-type", "f32", "--token-embedding-type", "f32", f32, files[t],
                   t.upper(), "2"], both=True)
        fallback = "q4_0" if "falling back to    q4_0" in log else t
        files[t] = (files[t], (2 * LLAMA_BPW[t] + LLAMA_BPW[fallback]) / 3, f"gate/up {t.upper()}, down "
                    f"{fallback.upper()} (llama-quantize)")
    common = ["--reference-model", model, "--text", text, "--text-tokens", args.text_tokens, "--device", "cpu",
              "--expert-cache", "off", "--json", "-"]
    configs = [(f"llama.cpp {t.upper()} file", [f, "--experts-format", "auto"], bpw, how)
               for t, (f, bpw, how) in files.items()]
    configs += [("hetmoe int2", [model, "--experts-format", "int2"], OWN_BPW["int2"], "own int2, all"),
                ("hetmoe int3", [model, "--experts-format", "int3"], OWN_BPW["int3"], "own int3, all"),
                ("hetmoe int4 g32", [model, "--experts-format", "int4", "--group-size", "32"], OWN_BPW["int4 g32"],
                 "int4 group 32, fp16 scales")]
    configs += [(f"hetmoe auto {b}", [model, "--experts-format", "auto", "--cpu-memory", b], None, "")
                for b in args.budgets.split(",") if b]
    rows = []
    for name, cmd, bpw, how in configs:
        report = json.loads(run([sys.executable, "-m", "hetmoe", "eval", "--model", *cmd, *common]))
        if bpw is None:  # an auto mix: its layers' formats, every layer's experts the same size
            layers = report["config"].get("layers", "")
            pairs = [part.split()[-1].split("/") for part in layers.split(": ", 1)[-1].split(", ")] if layers else []
            spans = [part.split()[0] for part in layers.split(": ", 1)[-1].split(", ")] if layers else []
            counts = [int(s.split("-")[1]) - int(s.split("-")[0]) + 1 if "-" in s else 1 for s in spans]
            # (int4 beside another format is affine group 32, k8 scales; a layer all int4 is the plan's int4 g64)
            per = [OWN_BPW["int4 g64"] if gu == d == "int4" else (2 * OWN_BPW[gu] + OWN_BPW[d]) / 3 for gu, d in pairs]
            bpw = sum(c * b for c, b in zip(counts, per)) / sum(counts)
            how = layers
        rows.append({"name": name, "bits_per_expert_weight": round(bpw, 4), "how": how, "kl": report["kl"],
                     "top1_agreement": report["top1_agreement"], "perplexity": report["perplexity"],
                     "reference_perplexity": report["reference_perplexity"], "tokens": report["tokens"]})
        print(f"{name:<26} {bpw:6.3f} bpw  KL {report['kl']:.3e}  top-1 {100 * report['top1_agreement']:6.2f} %  "
              f"ppl {report['perplexity']:.4f} (ref {report['reference_perplexity']:.4f})  {how}")
    if args.json:
        args.json.write_text(json.dumps({"text": str(text), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
