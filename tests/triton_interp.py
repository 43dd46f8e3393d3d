"""Triton kernels in tests: without CUDA they run in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton)."""

import importlib

import pytest
import torch


def triton_module(name: str):
    """The hetmoe module ``name`` (one that imports triton), or a skip without the triton package. Without CUDA the
    interpreter is patched once: numpy >= 2.4 refuses int() of the 1-element arrays it keeps scalars in (loop
    bounds)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import triton.runtime.interpreter as interp

        if not getattr(interp, "_hetmoe_index_patch", False):
            original = interp._patch_lang_tensor

            def patched(tensor, *rest):
                original(tensor, *rest)
                tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

            interp._patch_lang_tensor = patched
            interp._hetmoe_index_patch = True
    return importlib.import_module(name)
