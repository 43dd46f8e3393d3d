"""Reading GGUF files (llama.cpp's format) for hetmoe's models.

``open_gguf(path)`` opens one file or a split set (metadata, tensors memory-mapped; reader.py);
``config_from_gguf(f)`` turns its metadata into the Hugging Face config.json hetmoe's models take (metadata.py);
``hf_name`` / ``hf_tensors`` map its tensor names to the models' parameter names with the transforms that undo
llama.cpp's conversion (names.py); ``tokenizer_from_gguf(f)`` rebuilds its tokenizer as hetmoe's Tokenizer
(tokenizer.py); ``GGUFCheckpoint`` (checkpoint.py) is what the loader reads a GGUF model through
(hetmoe/load/loader.py ``open_checkpoint``). Needs the ``gguf`` package (``pip install -e '.[gguf]'`` in the
repository, or ``pip install gguf``).
"""

from hetmoe.load.gguf.metadata import ARCHITECTURES, config_from_gguf
from hetmoe.load.gguf.names import Transform, hf_name, hf_names, hf_tensors, merge_kv_b, unpermute_rope
from hetmoe.load.gguf.reader import GGUFError, GGUFFile, GGUFTensor, open_gguf
from hetmoe.load.gguf.tokenizer import tokenizer_from_gguf

__all__ = ["ARCHITECTURES", "GGUFError", "GGUFFile", "GGUFTensor", "Transform", "config_from_gguf", "hf_name",
           "hf_names", "hf_tensors", "merge_kv_b", "open_gguf", "tokenizer_from_gguf", "unpermute_rope"]
