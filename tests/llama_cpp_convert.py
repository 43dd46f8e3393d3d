"""llama.cpp's own convert_hf_to_gguf.py, run as a subprocess by the GGUF tests (tests/load/gguf/
test_gguf_llama_cpp.py): ``python tests/llama_cpp_convert.py LLAMA_CPP_DIR MODEL_DIR --outfile F --outtype T``.

The converter recognizes a BPE tokenizer by the hash of how it splits a fixed text, and knows only the tokenizers of
published models; the tests' tokenizer (hetmoe.load.random_weights.build_tokenizer: byte-level BPE with the GPT-2
split regex) is named "gpt-2" here, the pre-tokenizer it has, instead of being refused; and the GLM classes, whose
vocabulary writer looks up GLM's own special tokens ([gMASK], <|user|> ...), write it as every other byte-level BPE
model's is written. Nothing else is changed: the converter's model classes write the metadata and tensors exactly as
they do for a published checkpoint.
"""

from __future__ import annotations

import glob
import os
import runpy
import sys
from pathlib import Path
from typing import Optional


def llama_cpp_source() -> Optional[Path]:
    """llama.cpp's source tree for the tests that use it (its converter, its models/templates): $LLAMA_CPP_DIR, or
    the llama-cpp-python source distribution unpacked under /tmp/lcp (``pip download --no-binary :all: --no-deps
    llama-cpp-python``); None when neither is there (those tests skip)."""
    found = [os.environ.get("LLAMA_CPP_DIR", "")] + sorted(glob.glob("/tmp/lcp/*/vendor/llama.cpp"))
    return next((Path(p) for p in found if p and (Path(p) / "convert_hf_to_gguf.py").is_file()), None)


def main() -> None:
    source = Path(sys.argv[1])
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    sys.path[:0] = [str(source / "gguf-py"), str(source)]
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
