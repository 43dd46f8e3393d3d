"""Writes the built-in demo model (hetmoe/data/default_model) as a GGUF file with F32 tensors, llama.cpp's metadata
keys and tensor names and the model's tokenizer, so llama.cpp's own ``llama-quantize`` can make the quantized files
users run (Q6_K, Q4_K_M, ...); ``hetmoe eval --model THAT.gguf`` then measures what each way of holding their
experts costs (BENCHMARKS.md#accuracy).

It uses the tests' converter in miniature (tests/gguf_files.py: convert_hf_to_gguf.py's tensor transforms and keys),
since llama.cpp's convert_hf_to_gguf.py refuses the demo tokenizer's pre-tokenizer ("BPE pre-tokenizer was not
recognized"). The multi-token-prediction layer (num_nextn_predict_layers) is left out, as hetmoe does not run it.

Needs ``gguf`` and ``safetensors``: ``python3 -m pip install -e '.[gguf]'`` in the repository.

    python3 bench/demo_model_gguf.py --out demo-f32.gguf
    llama-quantize demo-f32.gguf demo-q6_k.gguf Q6_K
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "hetmoe" / "data" / "default_model"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="GGUF file to write")
    args = ap.parse_args(argv)
    if args.out.exists():
        ap.error(f"{args.out} exists; not overwriting it")

    try:
        import gguf  # noqa: F401  (tests/gguf_files.py writes with it)
        from safetensors.torch import load_file  # (torch's loader: the checkpoint is bf16, which numpy cannot hold)
    except ImportError as err:
        ap.error(f"{err.name} is not installed: python3 -m pip install -e '.[gguf]' (in {ROOT})")
    from tokenizers import Tokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    import gguf_files

    cfg = json.loads((MODEL / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    state = {}
    for part in sorted(MODEL.glob("model-*.safetensors")):
        for name, t in load_file(part).items():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= n_layers:
                continue  # the multi-token-prediction layer
            state[name] = t.float().numpy()
    tensors = gguf_files.to_gguf_tensors(cfg["model_type"], cfg, state)
    tokenizer = (Tokenizer.from_file(str(MODEL / "tokenizer.json")),
                 json.loads((MODEL / "tokenizer_config.json").read_text()), "gpt-2", cfg.get("vocab_size", 0))
    gguf_files.write_gguf(args.out, cfg["model_type"], cfg, tensors, tokenizer=tokenizer)
    print(f"wrote {args.out}: {len(tensors)} tensors, {args.out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
