"""The one table of formats for dense weights (attention projections, shared experts, dense MLPs, lm_head), on the
CPU (hetmoe/cpu/linear.py: the engine's packed row blocks and kernels) and on the GPU (hetmoe/layers/gpu_linear.py).
No torch: the plan reads it before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

# `tolerance`: the bound on a linear's output error against the bf16 weights, ||y - y_bf16|| / ||y_bf16||, over
# random N(0, 1) activations and N(0, 0.02) weights, measured by tests/cpu/test_linear.py and
# tests/layers/test_gpu_linear.py (the worst device and ISA path, with margin).


@dataclass(frozen=True)
class DenseFormat:
    name: str
    bits: int  # per weight element
    group: int  # weight elements along K per fp32 scale (0: no scales; fp8: a block of group x group)
    devices: tuple  # where it runs: "cpu", "cuda"
    tolerance: float

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of an [n, k] weight in this format (scales included; padding of the CPU row blocks excluded)."""
        data = n * k * self.bits // 8
        if not self.group:
            return data
        if self.name == "fp8":
            return data + -(-n // self.group) * -(-k // self.group) * 4
        return data + n * -(-k // self.group) * 4


# MEASURED worst cases (tests named above): bf16 1.7e-3 (the CPU's AMX class rounds activations to bf16; 3e-7 on
# the row blocks, 0 on the GPU); fp8 3.7e-2 (scaled_mm, activations in fp8 too); int8 g64 8.6e-3 (CPU AMX class),
# 6.6e-3 (GPU); int4 g64 9.6e-2 (CPU), 1.1e-1 (GPU).
DENSE_FORMATS = {
    "bf16": DenseFormat("bf16", 16, 0, ("cpu", "cuda"), 4e-3),
    "fp8": DenseFormat("fp8", 8, 128, ("cuda",), 6e-2),
    "int8": DenseFormat("int8", 8, 64, ("cpu", "cuda"), 1.5e-2),
    "int4": DenseFormat("int4", 4, 64, ("cpu", "cuda"), 1.5e-1),
}
DENSE_FORMAT_CHOICES = ("auto",) + tuple(DENSE_FORMATS)


def dense_format(name: str, device: str) -> DenseFormat:
    """The table entry for ``name`` on ``device`` ("cpu" or "cuda"); a clear error when it does not run there."""
    fmt = DENSE_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"dense format must be one of {', '.join(DENSE_FORMATS)}, got {name!r}")
    if device not in fmt.devices:
        raise ValueError(f"dense format {name} does not run on {device} (it runs on: {', '.join(fmt.devices)})")
    return fmt
