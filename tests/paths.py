"""The numerical paths of the CPU expert engine, which of them this machine runs, and the bounds between them.

A routed expert is computed on one of these paths. Within a path, results are bitwise reproducible (run to run,
across thread counts, whatever the token count or chunking); across paths the activations are rounded differently:

    path            kernels                                       activations read by the experts
    scalar          plain C++ row blocks                          fp32 (bf16 weights), int16 (int8), int8 (int4)
    avx2            AVX2/FMA row blocks (same bits as scalar)     same
    avx512          AVX-512 VNNI/BF16 row blocks (same bits)      same
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
    AVX-512 BF16/VNNI (e.g. Zen 4)    yes     yes   yes     yes           -     avx512: one class
    AMX (Sapphire Rapids and later)   yes     yes   yes     yes           yes   amx: mixed classes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hetmoe.kernels import AMX_EMULATED, cpu_info

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
# What isa="auto" runs here, and whether it can put experts of one call on different classes.
AUTO_MIXES_CLASSES = _INFO["best_isa"] == "amx"

# Cross-path bound for whole-model logits: max |a - b| / max |b| between the same forward pass computed on the
# row-block class and on the AMX class (or on the mixed default), fp32 dense part, on the tiny random
# checkpoints of hetmoe.engine.synthetic. MEASURED with tests/engine/test_cli.py's equality cases and the
# parity tests (row-block vs amx-emulated, every model_type) on the dev machine: bf16 experts 2.4e-4 (bf16 vs
# fp32 activations), int8 1.9e-3 (int8 vs int16 activations); int4 experts read int8 activations on both
# classes, so the bound is the within-path one. Bounds: ~2x the measurement.
LOGIT_CROSS_PATH_BOUND = {"bf16": 5e-4, "int8": 4e-3, "int4": 1e-5}
# Within one path the same tokens give the same logits whatever the split, up to the dense part's fp32
# summation order (attention over a cached prefix vs one shot).
LOGIT_SAME_PATH_BOUND = 1e-5


def ids(paths) -> list:
    return [str(p) for p in paths]
