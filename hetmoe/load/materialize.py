"""Filling a meta-built model from a checkpoint: dense tensors copied to their device in the plan's dtype
(``Materializer``; a linear packed on a GPU in a format other than bf16 is read into host memory first, dense.py
``on_host``), routed experts packed into the CPU engine (``fill_experts``). hetmoe/load/loader.py drives it
one decoder layer at a time.

Checkpoint tensors are found by the model's own parameter names (Hugging Face names); routed experts are
``<block>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`` (Mixtral: ``w1, w3, w2``).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from hetmoe.cpu import CPUExperts
from hetmoe.load.checkpoint import Checkpoint, CheckpointError
from hetmoe.load.dense import FP8Source, on_host
from hetmoe.plan.memory import MemoryPlan

EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # HF names of gate, up, down
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def expert_keys(ckpt: Checkpoint, prefix: str) -> tuple:
    for names in EXPERT_NAMES:
        if f"{prefix}.experts.0.{names[0]}.weight" in ckpt:
            return names
    raise CheckpointError(f"{ckpt.path}: no routed experts found for {prefix} (expected tensors like "
                          f"{prefix}.experts.0.gate_proj.weight)")


class Materializer:
    """Copies checkpoint tensors into a meta-built model, module by module."""

    def __init__(self, ckpt: Checkpoint, plan: MemoryPlan, fp8: Optional[FP8Source] = None):
        self.ckpt, self.plan, self.fp8 = ckpt, plan, fp8  # fp8: weights kept as stored (dense.FP8Source)
        self.used: set = set()

    def fill(self, model: nn.Module, prefix: str) -> None:
        """Every parameter and persistent buffer of ``model.get_submodule(prefix)`` (or of the globals when
        prefix is "" — everything outside model.layers)."""
        root = model.get_submodule(prefix) if prefix else model
        for mod_name, module in root.named_modules(prefix=prefix):
            if not prefix and _LAYER.match(mod_name + "."):
                continue
            host = on_host(module, mod_name, self.plan.dense_format, self.plan.device)  # packed from host memory
            for leaf, p in list(module._parameters.items()):
                if p is not None and not (self.fp8 is not None and self.fp8.take(module, f"{mod_name}.{leaf}")):
                    t = self._tensor(f"{mod_name}.{leaf}", p, device=torch.device("cpu") if host else None)
                    module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            persistent = [b for b in module._buffers if b not in module._non_persistent_buffers_set]
            for leaf in persistent:
                b = module._buffers[leaf]
                if b is not None:
                    module._buffers[leaf] = self._tensor(f"{mod_name}.{leaf}", b, keep_dtype=True)
            for leaf in module._non_persistent_buffers_set:
                b = module._buffers.get(leaf)
                if b is not None:
                    module._buffers[leaf] = b.to(self.plan.device)

    def _tensor(self, name: str, like: torch.Tensor, keep_dtype: bool = False, device=None) -> torch.Tensor:
        """The checkpoint's ``name`` in the plan's dtype (``like``'s with ``keep_dtype``) on ``device`` (default:
        the plan's), in memory of its own."""
        ckpt = self.ckpt
        if name not in ckpt and name == "lm_head.weight" and ckpt.config.get("tie_word_embeddings"):
            name = "model.embed_tokens.weight"
        dtype = like.dtype if keep_dtype else self.plan.dtype
        device = device or self.plan.device
        copies = getattr(ckpt, "floats_are_copies", False) and device.type == "cpu"
        if not like.is_floating_point():  # an integer table (DeepSeek-V4's tid2eid): as stored, cast exactly
            copies = False
            src = ckpt.get(name)
            if src.is_floating_point() or src.dtype == torch.bool:
                raise CheckpointError(f"tensor {name} has dtype {src.dtype} in {ckpt.path}; integers were expected")
        else:
            src = ckpt.get_float(name, dtype) if copies else ckpt.get_float(name)
        if tuple(src.shape) != tuple(like.shape):
            raise CheckpointError(f"tensor {name} has shape {list(src.shape)} in {ckpt.path}; the config implies "
                                  f"{list(like.shape)}")
        if copies and src.dtype == dtype:
            out = src.contiguous()  # dequantized into memory of its own, in the dtype (GGUF): no second copy
        else:
            out = torch.empty(like.shape, dtype=dtype, device=device)
            out.copy_(src)  # never a view of the mapped file
        self.used.add(name)
        return out


def fill_experts(ckpt: Checkpoint, prefix: str, experts: CPUExperts) -> None:
    """Pack the routed experts of block ``prefix`` from the checkpoint, one expert at a time (FP8 dequantized
    per expert, so at most one expert's fp32 copy exists at once). A GGUF file's experts of exactly held types
    (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) and a checkpoint's compressed-tensors pack-quantized int4 experts, loaded in the
    layout that holds them, are packed from their codes: nothing is re-quantized."""
    names = expert_keys(ckpt, prefix)
    H, I = experts.hidden_size, experts.intermediate_size
    if experts.bias:
        fill_biases(ckpt, prefix, names, experts)
    if getattr(ckpt, "load_exact_experts", lambda *a: False)(prefix, names, experts):
        return  # the checkpoint's own codes (GGUFCheckpoint / Checkpoint.load_exact_experts)
    for e in range(experts.num_experts):
        mats = []
        for which, want in zip(names, ((I, H), (I, H), (H, I))):
            key = f"{prefix}.experts.{e}.{which}.weight"
            if tuple(ckpt.shape(key)) != want:
                raise CheckpointError(f"tensor {key} has shape {list(ckpt.shape(key))}; expected {list(want)}")
            mats.append(ckpt.get_float(key))
        try:
            experts.load([mats[0]], [mats[1]], [mats[2]], first_expert=e)
        except ValueError as err:
            raise CheckpointError(f"{prefix}.experts.{e}: {err}") from None


def fill_biases(ckpt: Checkpoint, prefix: str, names: tuple, experts: CPUExperts) -> None:
    """The routed experts' biases of block ``prefix`` (experts made with bias=True: gpt-oss), per expert
    ``<prefix>.experts.<e>.<gate|up|down>.bias``, into the engine (fp32). CheckpointError naming the first one missing
    or of the wrong shape."""
    H, I = experts.hidden_size, experts.intermediate_size
    stacked = []
    for which, width in zip(names, (I, I, H)):
        rows = []
        for e in range(experts.num_experts):
            key = f"{prefix}.experts.{e}.{which}.bias"
            if key not in ckpt:
                raise CheckpointError(f"{ckpt.path}: tensor {key} is missing: this model's routed experts have biases")
            if tuple(ckpt.shape(key)) != (width,):
                raise CheckpointError(f"tensor {key} has shape {list(ckpt.shape(key))}; expected [{width}]")
            rows.append(ckpt.get_float(key, torch.float32))
        stacked.append(torch.stack(rows))
    try:
        experts.load_biases(*stacked)
    except ValueError as err:
        raise CheckpointError(f"{prefix}.experts: {err}") from None
