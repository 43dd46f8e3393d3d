"""Checkpoints quantized to int4 by GPTQ (quantization_config quant_method "gptq": GPTQModel, AutoGPTQ, optimum) and by
AWQ in its GEMM packing (quant_method "awq", version / format "gemm": AutoAWQ, GPTQModel), read as the codes, scales
and zero points they store (hetmoe/load/checkpoint.py turns them into the CPU engine's int4, nothing re-quantized).

One quantized linear ``<m>`` of shape [N, K] (out x in) is stored as

    GPTQ  <m>.qweight  int32 [K / 8, N]      eight codes of one output column per word, along K: input k = 8r + j
                                             in bits 4j..4j+3 of word [r, n]
          <m>.qzeros   int32 [G, N / 8]      eight zero points per word, along N: column n = 8c + j in bits 4j..
          <m>.scales   fp16  [G, N]
          <m>.g_idx    int32 [K]             the group of each input (k // group_size unless act-order)
    AWQ   <m>.qweight  int32 [K, N / 8]      along N, interleaved: nibble i of word [k, c] holds column 8c + ORDER[i]
          <m>.qzeros   int32 [G, N / 8]      the same interleaving
          <m>.scales   fp16  [G, N]

with G = K / group_size (1 for group_size -1: one group per output channel), codes u and zero points z in 0..15, and
``w[n, k] = scales[g, n] * (u[k, n] - z[g, n])`` for the input's group g (GPTQModel's dequantize_weight, AutoAWQ's
dequantize_gemm). GPTQ's zero points come in two conventions, named by ``checkpoint_format`` (or ``format``):
"gptq" (v1, AutoGPTQ's, and what GPTQModel still writes by default) stores every zero point minus one, the words
lowered by 0x11111111 as whole int32s (GPTQModel's convert_gptq_v2_to_v1_format), so a zero point of 0 borrows from
the next nibble; "gptq_v2" stores them as they are. The words are raised back by 0x11111111 (mod 2^32) before their
nibbles are read, exactly GPTQModel's convert_gptq_v1_to_v2_format, which undoes that borrow. (AutoGPTQ's older
kernels add one per nibble instead; they agree wherever no stored nibble is 15.) A symmetric checkpoint's zero
points are all 8 (the codes are q + 8, q in [-8, 7]); each is checked as it is read.

act-order (desc_act) quantizes the inputs in a permuted order and stores which group each input belongs to in
g_idx: the groups are then not runs of consecutive inputs, which the engine's layout needs, and holding them would
mean permuting every expert's activations by its own order. hetmoe refuses desc_act unless static_groups says the
groups stayed in place, and checks that each g_idx it reads is k // group_size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from hetmoe.load.compressed import (
    SCALE_DTYPES,
    PackedWeight,
    QuantizationConfigError,
    engine_group,
    nibbles,
    unpack_int4,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column 8c + j sits in nibble AWQ_COLUMN_NIBBLE[j]
V1_OFFSET = 0x11111111  # one added to each nibble of a v1 zero-point word, carries included
SYMMETRIC_ZERO = 8
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # g_idx may be absent (then k // group_size)
AWQ_PARTS = ("qweight", "qzeros", "scales")
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> zero points stored minus one
_DYNAMIC_KEYS = ("bits", "group_size", "sym", "desc_act", "pack_dtype", "format")


@dataclass(frozen=True)
class Int4Scheme:
    """A GPTQ or AWQ quantization_config this reader handles: int4, per group (or per output channel), packed in
    int32 words, weights only."""

    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group per output channel
    symmetric: bool
    zeros_minus_one: bool  # GPTQ v1: zero points stored minus one
    skip: tuple = ()  # module-name patterns left unquantized (GPTQModel's dynamic "-:" entries, AWQ's
    # modules_to_not_convert), for the error naming a packed module the config leaves out

    @property
    def parts(self) -> tuple:
        return GPTQ_PARTS if self.method == "gptq" else AWQ_PARTS

    @property
    def what(self) -> str:
        return "GPTQ int4" if self.method == "gptq" else "AWQ (gemm) int4"

    @classmethod
    def parse(cls, qc, where: str = "config.json") -> "Int4Scheme":
        """``qc`` (config.json's quantization_config, quant_method gptq or awq) checked setting by setting;
        QuantizationConfigError naming the first one this reader does not handle (``where``: the file)."""
        def refuse(setting: str, value, why: str):
            raise QuantizationConfigError(f"{where}: quantization_config.{setting} is {value!r}; {why}")

        if not isinstance(qc, dict):
            raise QuantizationConfigError(f"{where}: the checkpoint holds GPTQ / AWQ tensors (*.qweight) but "
                                          f"quantization_config is {qc!r}; it must describe them")
        method = qc.get("quant_method")
        if method not in ("gptq", "awq"):
            refuse("quant_method", method, "tensors stored as qweight / qzeros / scales are read for gptq and awq")
        supported = ("hetmoe reads GPTQ int4 (bits 4, checkpoint_format gptq or gptq_v2, int32 words, group_size -1 "
                     "or a multiple of 32) and AWQ int4 in its gemm packing, weights only")
        if qc.get("bits") != 4:
            refuse("bits", qc.get("bits"), f"the CPU engine holds 4-bit codes of these formats ({supported})")
        group = qc.get("group_size", 128 if method == "awq" else None)
        if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0):
            refuse("group_size", group, "it must be -1 (per output channel) or a positive group of inputs")
        if group != -1 and engine_group(group) is None:
            refuse("group_size", group, "the CPU engine's int4 holds groups of 32, 64 or 128 (a group of a multiple "
                                        "of 32 is held in those)")
        if qc.get("pack_dtype", "int32") != "int32":
            refuse("pack_dtype", qc["pack_dtype"], "codes are read from int32 words")
        for key in ("rotation", "activation", "adapter"):
            if qc.get(key):
                refuse(key, qc[key], f"hetmoe runs plain weights ({supported})")
        if method == "gptq":
            fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
            if fmt not in _GPTQ_FORMATS:
                refuse("checkpoint_format" if "checkpoint_format" in qc else "format", fmt,
                       f"GPTQ checkpoints are read in the gptq (v1) and gptq_v2 formats ({supported})")
            sym = qc.get("sym", True)
            if not isinstance(sym, bool):
                refuse("sym", sym, "it must be true or false")
            desc_act = qc.get("desc_act", False)
            meta = qc.get("meta") if isinstance(qc.get("meta"), dict) else {}
            static = qc.get("static_groups", meta.get("static_groups", False))
            if desc_act and not static:
                refuse("desc_act", desc_act, "act-order groups (a g_idx that permutes the inputs) would need every "
                       "expert's activations permuted by its own order, which the CPU engine does not do; quantize "
                       "with desc_act false (or static_groups true)")
            skip = _dynamic_skips(qc.get("dynamic"), qc, refuse)
            return cls("gptq", group, sym, _GPTQ_FORMATS[fmt], skip)
        awq_formats = ("AWQ checkpoints are read in the gemm packing (AutoAWQ's default); gemv, gemv_fast, llm-awq, "
                       "exllama and marlin pack their words otherwise")
        setting = "version" if "version" in qc else "format"
        if str(qc.get(setting, "gemm")).lower() != "gemm":
            refuse(setting, qc[setting], awq_formats)
        if qc.get("backend") == "llm-awq":  # (transformers' AwqConfig: the llm-awq format)
            refuse("backend", qc["backend"], awq_formats)
        zero_point = qc.get("zero_point", True)
        if not isinstance(zero_point, bool):
            refuse("zero_point", zero_point, "it must be true or false")
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            refuse("modules_to_not_convert", skip, "it must be a list of module names")
        return cls("awq", group, not zero_point, False, tuple(skip))

    def leaves_out(self, module: str) -> bool:
        """Whether the config says ``module`` stays unquantized."""
        if self.method == "awq":
            return any(s in module for s in self.skip)  # transformers' rule: a substring of the name
        return any(re.match(p, module) for p in self.skip)


def _dynamic_skips(dynamic, qc: dict, refuse) -> tuple:
    """GPTQModel's per-module overrides: "-:<regex>" leaves modules unquantized (their patterns returned); any other
    entry that changes how weights are stored is refused by name."""
    if dynamic in (None, {}):
        return ()
    if not isinstance(dynamic, dict):
        refuse("dynamic", dynamic, "it must map module patterns to overrides")
    skip = []
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            skip.append(pattern[2:])
            continue
        if not isinstance(override, dict):
            refuse(f"dynamic.{pattern}", override, "an override is an object")
        for key in _DYNAMIC_KEYS:
            if key in override and override[key] != qc.get(key):
                refuse(f"dynamic.{pattern}.{key}", override[key], "per-module overrides of how weights are stored "
                       "are not read")
    for p in skip:
        try:
            re.compile(p)
        except re.error as err:
            refuse("dynamic", f"-:{p}", f"its pattern does not compile ({err})")
    return tuple(skip)


def check_parts(module: str, parts: dict, scheme: Int4Scheme) -> PackedWeight:
    """``parts``: stored tensor name (qweight, qzeros, scales, g_idx) -> (dtype, shape), headers only. The
    PackedWeight they describe, or QuantizationConfigError naming the tensor whose dtype or shape disagrees."""
    required = ("qweight", "qzeros", "scales")
    missing = [p for p in required if p not in parts]
    if missing:
        raise QuantizationConfigError(f"{module}.qweight has no {', '.join(f'{module}.{p}' for p in missing)} "
                                      "beside it")
    (wdt, wshape), (zdt, zshape), (sdt, sshape) = (parts[p] for p in required)
    gptq = scheme.method == "gptq"
    layout = "[K / 8, N]: eight codes along K" if gptq else "[K, N / 8]: eight codes along N"
    if wdt != torch.int32 or len(wshape) != 2:
        raise QuantizationConfigError(f"{module}.qweight is {wdt} {list(wshape)}; {scheme.what} codes are int32 "
                                      f"words {layout}")
    K, N = (8 * wshape[0], wshape[1]) if gptq else (wshape[0], 8 * wshape[1])
    g = K if scheme.group_size == -1 else scheme.group_size
    if K % g:
        raise QuantizationConfigError(f"{module}: quantization_config.group_size {g} does not divide its {K} inputs "
                                      f"({module}.qweight {list(wshape)})")
    group = engine_group(g)
    if group is None:
        raise QuantizationConfigError(f"{module}: one group per output channel of {K} inputs; the CPU engine's int4 "
                                      "holds them in groups of 32, 64 or 128, none of which divides it")
    G = K // g
    if sdt not in SCALE_DTYPES:
        raise QuantizationConfigError(f"{module}.scales has dtype {sdt}; scales are read from fp16, bf16 or fp32")
    if tuple(sshape) != (G, N):
        raise QuantizationConfigError(f"{module}.scales has shape {list(sshape)}; {module}.qweight {list(wshape)} "
                                      f"holds [{N}, {K}] (out, in), which in groups of {g} needs [{G}, {N}]")
    if N % 8 or zdt != torch.int32 or tuple(zshape) != (G, N // 8):
        raise QuantizationConfigError(f"{module}.qzeros is {zdt} {list(zshape)}; {G} groups of {N} zero points "
                                      f"packed eight to an int32 need int32 [{G}, {N / 8:g}]")
    if "g_idx" in parts and (parts["g_idx"][0] not in (torch.int32, torch.int64) or tuple(parts["g_idx"][1]) != (K,)):
        raise QuantizationConfigError(f"{module}.g_idx is {parts['g_idx'][0]} {list(parts['g_idx'][1])}; it must "
                                      f"hold the group of each of the {K} inputs (int32 [{K}])")
    return PackedWeight(module, (N, K), group, sdt, symmetric=scheme.symmetric, method=scheme.method, file_group=g,
                        zeros_minus_one=scheme.zeros_minus_one, per_channel=scheme.group_size == -1)


def _transposed(words: torch.Tensor) -> torch.Tensor:
    """int32 [a, b] -> [b, a] in fresh row-major memory (``.contiguous()`` keeps odd strides on size-1 dims, which a
    byte view refuses)."""
    return torch.empty(words.shape[1], words.shape[0], dtype=words.dtype).copy_(words.t())


def gptq_codes(qweight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GPTQ codes u (0..15) [N, K] of qweight int32 [K / 8, N], uint8 (or written into int8 ``out``). The words
    transposed to [N, K / 8] hold eight inputs each as compressed-tensors' do, so their nibbles split the same way."""
    u = unpack_int4(_transposed(qweight), None if out is None else out.view(torch.int8))  # u - 8
    u.add_(8)
    return u.view(torch.uint8) if out is None else out


def awq_codes(qweight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """AWQ codes u (0..15) [N, K] of qweight int32 [K, N / 8] (interleaved columns), uint8 (or written into int8
    ``out``): nibble i of the transposed words [N / 8, K] is output row 8c + AWQ_ORDER[i]."""
    K, n8 = qweight.shape
    words = _transposed(qweight).view(torch.uint8).view(n8, K, 4)  # byte b: nibbles 2b (low), 2b + 1 (high)
    if out is None:
        out = torch.empty(8 * n8, K, dtype=torch.uint8)
    rows = out.view(torch.uint8).view(n8, 8, K)
    for i, row in enumerate(AWQ_ORDER):
        b = words[:, :, i // 2]
        if i % 2:
            torch.bitwise_right_shift(b, 4, out=rows[:, row])
        else:
            torch.bitwise_and(b, 0x0F, out=rows[:, row])
    return out


def awq_columns(words: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8 * n] of AWQ-interleaved int32 words [R, n], in column order."""
    nib = nibbles(words).view(words.shape[0], words.shape[1], 8)
    return nib[..., list(AWQ_COLUMN_NIBBLE)].reshape(words.shape[0], 8 * words.shape[1])


def gptq_zeros(qzeros: torch.Tensor, minus_one: bool) -> torch.Tensor:
    """Zero points z (uint8 0..15) [G, N] of GPTQ qzeros int32 [G, N / 8] (v1: the words raised by 0x11111111)."""
    if minus_one:
        qzeros = ((qzeros.to(torch.int64) + V1_OFFSET) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)
    return nibbles(qzeros)


def zeros_of(pw: PackedWeight, qzeros: torch.Tensor) -> torch.Tensor:
    """The zero points z (uint8 0..15) [G, N] of ``pw``'s stored qzeros."""
    return gptq_zeros(qzeros, pw.zeros_minus_one) if pw.method == "gptq" else awq_columns(qzeros)


def codes_of(pw: PackedWeight, qweight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The codes u (0..15) [N, K] of ``pw``'s stored qweight: uint8, or written into int8 ``out``."""
    return gptq_codes(qweight, out) if pw.method == "gptq" else awq_codes(qweight, out)


def check_g_idx(pw: PackedWeight, g_idx: Optional[torch.Tensor]) -> None:
    """QuantizationConfigError unless ``g_idx`` (None: not stored) puts input k in group k // group_size."""
    if g_idx is None:
        return
    K = pw.shape[1]
    want = torch.arange(K, dtype=torch.int64) // pw.file_group
    if not torch.equal(g_idx.to(torch.int64), want):
        k = int((g_idx.to(torch.int64) != want).nonzero()[0])
        raise QuantizationConfigError(f"{pw.module}.g_idx puts input {k} in group {int(g_idx[k])}, not "
                                      f"{k // pw.file_group}: act-order groups (desc_act) are not read (the CPU "
                                      "engine's groups are runs of consecutive inputs)")


def check_symmetric_zeros(pw: PackedWeight, z: torch.Tensor) -> None:
    """QuantizationConfigError unless every zero point of a symmetric checkpoint is 8."""
    if not bool((z == SYMMETRIC_ZERO).all()):
        g, n = (int(i) for i in (z != SYMMETRIC_ZERO).nonzero()[0])
        raise QuantizationConfigError(f"{pw.module}.qzeros holds the zero point {int(z[g, n])} (group {g}, output "
                                      f"{n}); quantization_config says symmetric, whose zero points are all "
                                      f"{SYMMETRIC_ZERO}")


def pack_gptq(u: torch.Tensor, z: torch.Tensor, minus_one: bool) -> tuple:
    """The inverse of gptq_codes / gptq_zeros, as GPTQModel packs: codes u [N, K] and zero points z [G, N] (0..15)
    -> (qweight int32 [K / 8, N], qzeros int32 [G, N / 8]); ``minus_one``: v1 zero points (words lowered by
    0x11111111)."""
    N, K = u.shape
    w = u.to(torch.int64).t().reshape(K // 8, 8, N)  # [K/8, j, N]
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    qweight = (w << shifts).sum(1)
    zz = z.to(torch.int64).reshape(z.shape[0], -1, 8)
    qzeros = (zz << shifts.view(1, 1, 8)).sum(-1)
    if minus_one:
        qzeros = (qzeros - V1_OFFSET) & 0xFFFFFFFF
    return tuple(t.to(torch.uint32).view(torch.int32).contiguous() for t in (qweight, qzeros))


def pack_awq(u: torch.Tensor, z: torch.Tensor) -> tuple:
    """The inverse of awq_codes / zeros, as AutoAWQ's WQLinear_GEMM.from_linear packs: codes u [N, K] and zero points
    z [G, N] -> (qweight int32 [K, N / 8], qzeros int32 [G, N / 8])."""
    def words(cols: torch.Tensor) -> torch.Tensor:  # [R, 8n] in column order -> [R, n]
        c = cols.to(torch.int64).view(cols.shape[0], -1, 8)[..., list(AWQ_ORDER)]  # nibble i <- column ORDER[i]
        shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8)
        return ((c << shifts).sum(-1) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32).contiguous()

    return words(u.t().contiguous()), words(z)
