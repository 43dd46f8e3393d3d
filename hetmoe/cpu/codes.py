"""Routed experts packed from codes quantized already, with no re-quantization: what a GGUF file's Q8_0 and Q4_0
blocks hold (one scale per 32 values: int8 codes in [-127, 127], 4-bit codes in [-8, 7] once llama.cpp's +8 offset
is taken off) become the engine's int8 / int4 formats with group 32 exactly, so the kernels multiply by the very
values ``gguf``'s own dequantization gives. The packing itself is csrc/formats/pack.cpp (pack_row_block_codes).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hetmoe.cpu.experts import CPUExperts

CODE_RANGE = {"int8": (-127, 127), "int4": (-8, 7)}


def load_codes(experts: CPUExperts, codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
               first_expert: int = 0) -> None:
    """Pack experts ``first_expert ..`` of ``experts`` (grouped int8 or int4) from ``codes`` = (gate, up, down) int8
    [n, I, H] / [n, I, H] / [n, H, I] and ``scales`` = the same matrices' fp32 [n, rows, cols / group] (one per
    group of ``group_size`` consecutive columns of a row). ValueError, naming the matrix, for a shape, dtype, group or
    range the engine cannot hold exactly; nothing of a refused call is marked loaded."""
    info = experts.info()
    fmt, group = info["weight_format"], info["group_size"]
    if fmt not in CODE_RANGE or group <= 0:
        raise ValueError(f"codes load into grouped int8 or int4 experts; these are {fmt} (group {group})")
    if len(codes) != 3 or len(scales) != 3:
        raise ValueError("codes and scales must each hold (gate, up, down)")
    I, H = experts.intermediate_size, experts.hidden_size
    n = codes[0].shape[0] if codes[0].dim() == 3 else -1
    if not 0 <= first_expert or n < 0 or first_expert + n > experts.num_experts:
        raise ValueError(f"experts [{first_expert}, {first_expert + n}) do not fit in "
                         f"num_experts={experts.num_experts}")
    lo, hi = CODE_RANGE[fmt]
    ready = []
    for name, q, s, (rows, cols) in zip(("gate", "up", "down"), codes, scales, ((I, H), (I, H), (H, I))):
        if cols % group:
            raise ValueError(f"{name}: {cols} columns are not a multiple of the group size {group}")
        if q.dtype != torch.int8 or tuple(q.shape) != (n, rows, cols):
            raise ValueError(f"{name} codes must be int8 [{n}, {rows}, {cols}], got {q.dtype} {list(q.shape)}")
        if tuple(s.shape) != (n, rows, cols // group):
            raise ValueError(f"{name} scales must be [{n}, {rows}, {cols // group}] (one per {group} columns), "
                             f"got {list(s.shape)}")
        q = q.detach().to("cpu").contiguous()
        if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
            raise ValueError(f"{name} has codes in [{int(q.min())}, {int(q.max())}]; {fmt} holds [{lo}, {hi}] exactly")
        s = s.detach().to("cpu", torch.float32).contiguous()
        if not torch.isfinite(s).all():
            raise ValueError(f"{name} has scales that are NaN or Inf")
        ready += [q, s]
    gq, gs, uq, us, dq, ds = ready
    experts._ex.load_codes(first_expert, n, gq.data_ptr(), gs.data_ptr(), uq.data_ptr(), us.data_ptr(),
                           dq.data_ptr(), ds.data_ptr())
