"""Routed experts of a float checkpoint quantized at load into hetmoe's own int3 / int2 (and int4 beside them in a
layer whose gate/up and down differ): hetmoe/cpu/lowbit.py quantizes and packs, one expert at a time (at most one
expert's fp32 copy at once); hetmoe/plan/lowbit.py chooses the formats."""

from __future__ import annotations

from hetmoe.cpu import CPUExperts
from hetmoe.cpu.lowbit import VERSION, load_floats
from hetmoe.load.checkpoint import Checkpoint, CheckpointError
from hetmoe.load.materialize import expert_keys, fill_biases
from hetmoe.plan.memory import LayerPlan


def low_bit_formats(lp: LayerPlan) -> tuple:
    """(gate/up, down) formats of a layer the loader quantizes itself."""
    return lp.experts_format, lp.down_format or lp.experts_format


def low_bit_key(lp: LayerPlan) -> str:
    """The layer's format as the expert cache keys it: the plain format, or for a layer quantized here its
    (gate/up, down) formats and the quantizer's version (``int3+int4-q2``)."""
    gu, down = low_bit_formats(lp)
    if gu == down and gu not in ("int3", "int2"):
        return gu
    return f"{gu}+{down}-q{VERSION}"


def fill_low_bits(ckpt: Checkpoint, prefix: str, experts: CPUExperts, formats: tuple) -> None:
    """Quantize the routed experts of block ``prefix`` into ``experts`` (made with cpu.lowbit.layout(*formats))."""
    names = expert_keys(ckpt, prefix)
    H, I = experts.hidden_size, experts.intermediate_size
    if experts.bias:
        fill_biases(ckpt, prefix, names, experts)
    for e in range(experts.num_experts):
        mats = []
        for which, want in zip(names, ((I, H), (I, H), (H, I))):
            key = f"{prefix}.experts.{e}.{which}.weight"
            if tuple(ckpt.shape(key)) != want:
                raise CheckpointError(f"tensor {key} has shape {list(ckpt.shape(key))}; expected {list(want)}")
            mats.append(ckpt.get_float(key)[None])
        try:
            load_floats(experts, *mats, formats, first_expert=e)
        except ValueError as err:
            raise CheckpointError(f"{prefix}.experts.{e}: {err}") from None
