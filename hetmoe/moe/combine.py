"""The *combine* stage: how a MoE layer's parts become its output, in one fixed order for every path (eager,
deferred, stream-ordered), so that every placement adds the same numbers the same way."""

from __future__ import annotations

from typing import Optional

import torch


def combine(main: torch.Tensor, resident: Optional[torch.Tensor], deferred: Optional[torch.Tensor],
            dtype: torch.dtype, shared: Optional[torch.Tensor]) -> torch.Tensor:
    """The routed output of a layer, [T, H] in ``dtype``: the CPU (or single backend's) part ``main``, plus the
    GPU-resident experts' part, plus the previous layer's deferred part, in this order and in fp32 wherever a part
    is fp32, cast to ``dtype`` once; then the shared experts (already in ``dtype``) are added. Every path of a MoE
    layer (eager, deferred, stream-ordered) ends here."""
    y = main
    if resident is not None:
        y = y + resident
    if deferred is not None:
        y = y + deferred
    y = y.to(dtype)
    return y if shared is None else y + shared
