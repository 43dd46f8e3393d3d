"""The numerical paths of the CPU expert engine, which of them this machine runs, and the bounds between them.

A routed expert is computed on one of these paths. Within a path, results are bitwise reproducible (run to run,
across thread counts, whatever the token count or chunking); across paths the activations are rounded differently:

    path            kernels                                       activations read by the experts
    scalar          plain C++ row blocks                          fp32 (bf16 weights), int16 (int8), int8 (int4)
    avx2            AVX2/FMA row blocks (same bits as scalar)     same
    avx512          AVX-512 VNNI row blocks (same bits)           same
    amx-emulated    the AMX tile GEMM in plain C++ (any CPU)      bf16 (bf16 weights), int8 per group (int8, int4)
    amx             the AMX tile GEMM on the tile unit            same as amx-emulated (int8/int4 bitwise, bf16
                                                                  within the hardware's fp32 summation order)

The row-block levels give the same bits as each other; the two AMX paths give the same bits as each other for
int8/int4. The engine's default on an AMX machine (``isa="auto"``) mixes the two classes *per expert and call*:
an expert with at least ``amx_min_tokens`` tokens takes the AMX GEMM, one with fewer the AVX-512 row blocks. So
splitting a prompt differently (chunked prefill, a cached prefix, a batch) changes which class an expert takes,
and the results agree only within the cross-path bound below. An engine forced to one path
(``PATHS[name].options``: an AMX path with ``amx_min_tokens=1`` puts every expert on the GEMM) is bitwise
reproducible under any split.

Which paths a CPU exercises (the suite runs every one it can; ``HETMOE_MAX_ISA`` caps a machine to a smaller one):

    CPU                               scalar  avx2  avx512  amx-emulated  amx   auto (the default) is
    AVX2 only (e.g. EPYC, capped)     yes     yes   -       yes           -     avx2: one class
    AVX-512 VNNI (Zen 4, Ice Lake)    yes     yes   yes     yes           -     avx512: one class
    AMX (Sapphire Rapids and later)   yes     yes   yes     yes           yes   amx: mixed classes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hetmoe.cpu import AMX_EMULATED, cpu_info

_INFO = cpu_info()


@dataclass(frozen=True)
class EnginePath:
    name: str
    isa: str  # CPUExperts(isa=...) / EngineOptions.isa
    amx_min_tokens: Optional[int]  # 1 on the AMX paths: every expert on the tile GEMM, whatever its token count

    @property
    def amx(self) -> bool:
        return self.isa in ("amx", AMX_EMULATED)

    @property
    def options(self) -> dict:
        """Keyword arguments for ``EngineOptions`` (and ``CPUExperts``) that force this path."""
        return {"isa": self.isa, "amx_min_tokens": self.amx_min_tokens}

    def __str__(self) -> str:
        return self.name


ALL_PATHS = (
    EnginePath("scalar", "scalar", None),
    EnginePath("avx2", "avx2", None),
    EnginePath("avx512", "avx512", None),
    EnginePath(AMX_EMULATED, AMX_EMULATED, 1),
    EnginePath("amx", "amx", 1),
)
# The paths this machine runs (within HETMOE_MAX_ISA): the emulated AMX GEMM runs everywhere.
PATHS = {p.name: p for p in ALL_PATHS if p.isa == AMX_EMULATED or p.isa in _INFO["supported_isas"]}
BEST_ROW_PATH = PATHS[next(i for i in ("avx512", "avx2", "scalar") if i in PATHS)]
BEST_AMX_PATH = PATHS.get("amx", PATHS[AMX_EMULATED])  # the tile unit where there is one, else its emulation
# One path of each class: for whole-model tests too costly to run on every path (the row-block paths give the same
# bits as each other, and the two AMX paths for int8/int4: tests/cpu checks both claims on every path).
CLASS_PATHS = (BEST_ROW_PATH, BEST_AMX_PATH)
# What isa="auto" runs here, and whether it can put experts of one call on different classes.
AUTO_MIXES_CLASSES = _INFO["best_isa"] == "amx"

# The engine left to choose per expert and call: the AMX GEMM from the format's amx_min_tokens, the row blocks below
# (emulated here, so every machine exercises the mixing that isa="auto" does on an AMX CPU).
MIXED_PATH = EnginePath("amx-emulated-mixed", AMX_EMULATED, None)
# What isa="auto" runs on this machine.
AUTO_PATH = EnginePath("auto", "auto", None)


def mixes_classes(path: EnginePath) -> bool:
    """Whether one call on this path may compute some experts on the row-block class and others on the AMX one."""
    return path.amx_min_tokens is None and (path.isa == AMX_EMULATED or (path.isa == "auto" and AUTO_MIXES_CLASSES))


# Whole-model logits, max |a - b| / max |b|, fp32 dense part, on the tiny random checkpoints of
# hetmoe.load.random_weights (11-token prompt, then 2 decode steps), every model_type. MEASURED on the dev machine
# (AVX-512 Zen 4; amx-emulated gives the AMX class's bits for int8/int4), worst model in brackets:
#
#                              bf16 experts           int8 experts           int4 experts
#   row class vs AMX class     5.1e-4 (deepseek_v3)   2.1e-3 (deepseek_v3)   0 (both read int8 activations)
#   one path, chunked (3) vs   3.1e-7                 4.1e-6 (mixtral)       3.1e-7
#   one shot (either class)
#   mixed, chunked vs one shot 3.9e-4 (deepseek_v3)   2.1e-3 (deepseek_v3)   3.1e-7
#
# Bounds: about 2x the measured maxima. Across classes the bound is the activation rounding's; within one path the
# same tokens give the same logits whatever the split, up to the dense part's fp32 summation order (attention over
# a cached prefix vs one shot) seen through the experts' activation quantization.
# native tdpbf16ps vs its emulation (fp32 sums of pair products in a fixed order): the hardware rounds its
# accumulation differently; measured 2.8e-5 (bf16 experts, 2026-11-29) and 4.8e-5 (fp8 experts on bf16 tiles,
# 2026-12-07) on the GPU machine's Xeon; bound with ~2x margin. int8/int4 tiles: bitwise.
NATIVE_BF16_TOL = 1e-4

LOGIT_SAME_PATH_BOUND = 1e-5
LOGIT_CROSS_PATH_BOUND = {"bf16": 1e-3, "int8": 4e-3, "int4": LOGIT_SAME_PATH_BOUND}


def logit_bound(path: EnginePath, fmt: str) -> float:
    """The bound for two splittings of the same tokens on ``path`` (chunked vs one shot, batch vs alone, ...)."""
    return LOGIT_CROSS_PATH_BOUND[fmt] if mixes_classes(path) else LOGIT_SAME_PATH_BOUND


def ids(paths) -> list:
    return [str(p) for p in paths]
