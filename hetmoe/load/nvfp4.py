"""NVFP4 linears of Hugging Face checkpoints, read as the codes and scales the expert engine's lut4 format holds
exactly (hetmoe/cpu/codes.py, csrc/formats/layout.h): routed experts are packed from their own nibbles, every other
linear is dequantized into the dense part, nothing is re-quantized.

NVFP4 is 4-bit E2M1 codes with one E4M3 scale per 16 consecutive inputs and one fp32 factor per matrix. Two writers
store it, each a matrix [N, K] (out x in) as three tensors beside ``<m>``:

    compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's NVFP4 / NVFP4A16 schemes):
        <m>.weight_packed        uint8 [N, K / 2]
        <m>.weight_scale         float8_e4m3fn [N, K / 16]
        <m>.weight_global_scale  fp32 [1]
        w = e2m1(q) * (fp32(weight_scale) / weight_global_scale)       (the factor divides: compressed-tensors'
                                                                         forward_helpers._dequantize)
    NVIDIA ModelOpt (quant_method "modelopt", quant_algo NVFP4 or W4A16_NVFP4; config.json's quantization_config or,
    in older exports, hf_quant_config.json):
        <m>.weight               uint8 [N, K / 2]
        <m>.weight_scale         float8_e4m3fn [N, K / 16]
        <m>.weight_scale_2       fp32 [] (or [1])
        w = e2m1(q) * (fp32(weight_scale) * weight_scale_2)            (the factor multiplies: ModelOpt's
                                                                         NVFP4QTensor.dequantize)

Both pack byte j of a row as column 2j in its low nibble and column 2j + 1 in its high one (compressed-tensors'
pack_fp4_to_uint8, ModelOpt's ``q[..., 1::2] << 4 | q[..., 0::2]``), each nibble an E2M1 index: bit 3 the sign,
bits 0..2 into (0, 0.5, 1, 1.5, 2, 3, 4, 6). The scale product is one fp32 rounding in both references, then one
more for the product with the code: the engine's e2m1 codebook holds the E2M1 values doubled (integers), so its
scale is that fp32 product halved (exact), and codebook value x scale is bitwise the reference's value.

With hetmoe/cpu/codes.py E4M3_HELD, the engine holds those scales at the file's bytes: scale dtype e4m3 (ModelOpt:
the factor multiplies) or e4m3_div (compressed-tensors: it divides) keeps each E4M3 byte and each matrix's factor, and
the kernels widen a byte to that very fp32 product (or quotient), halved (csrc/formats/layout.h): 4.5 bits a weight,
as the file. A factor whose 2^7 multiple (2^-7 for a divisor) is not a normal fp32, or that is not positive (and
every factor while E4M3_HELD is off), has its scales held widened: fp16 where every factor of the layer's gate and up
(or of its down) is a power of two that keeps each E4M3 value, halved, within fp16's exact range (5 bits a weight,
1.11x the file), fp32 otherwise (6 bits, 1.33x). A layer planned as int8 (its codebook values as int8 codes) takes
those widened scales too.

The activation scales (compressed-tensors' ``input_global_scale``, ModelOpt's ``input_scale``: NVFP4 W4A4) and a KV
cache scheme quantize activations at run time in engines that do so; the weights are exact without them, and hetmoe,
a weight-only engine, reads neither (its activations are those of the plan's dtype).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from hetmoe.cpu import codes as codes_module
from hetmoe.cpu.codes import load_codes, lut4_values
from hetmoe.cpu.layout import CODEBOOKS
from hetmoe.load.compressed import UNSUPPORTED, Group, PackQuantized, QuantizationConfigError, config_groups, nibbles

GROUP = 16  # inputs per E4M3 scale
CT_FORMAT = "nvfp4-pack-quantized"
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
CHUNK = 8  # routed experts unpacked and packed into the engine at once
# the stored tensors of one linear beside <m>: (codes, E4M3 scales, the fp32 factor, the activation scale (ignored))
PARTS = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
         "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale")}
# fp16 holds e4m3 * 2^j exactly for every E4M3 value (2^-9 .. 448) when j is in this range (2^-24 .. 65504)
FP16_EXPONENTS = range(-15, 8)


@dataclass(frozen=True)
class Scheme:
    """An NVFP4 quantization_config this reader handles: who wrote it and (compressed-tensors) which modules its
    config groups quantize."""

    producer: str  # "compressed-tensors" or "modelopt"
    targets: Optional[PackQuantized] = None  # compressed-tensors: the groups' targets and ignore

    @property
    def divides(self) -> bool:
        return self.producer == "compressed-tensors"

    @classmethod
    def parse(cls, qc, where: str = "config.json") -> "Scheme":
        """``qc`` (quantization_config) checked setting by setting; QuantizationConfigError naming the first one
        this reader does not handle."""
        if not isinstance(qc, dict):
            raise QuantizationConfigError(f"{where}: quantization_config is {qc!r}; it must describe NVFP4 weights")

        def refuse(setting: str, value, why: str):
            raise QuantizationConfigError(f"{where}: quantization_config.{setting} is {value!r}; {why}")

        if qc.get("quant_method") == "modelopt":
            return cls._modelopt(qc, refuse)
        return cls._compressed(qc, refuse)

    @classmethod
    def _modelopt(cls, qc: dict, refuse) -> "Scheme":
        supported = (f"hetmoe reads ModelOpt NVFP4 weights (quant_algo {' or '.join(MODELOPT_ALGOS)}: E2M1 in groups "
                     f"of {GROUP}, E4M3 scales, an fp32 weight_scale_2)")
        algo = qc.get("quant_algo")
        if str(algo).upper() not in MODELOPT_ALGOS:
            refuse("quant_algo", algo, supported)
        if qc.get("group_size", GROUP) != GROUP:
            refuse("group_size", qc["group_size"], f"NVFP4 has one scale per {GROUP} inputs ({supported})")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            refuse("config_groups", groups, "it must map group names to their schemes")
        for name, scheme in groups.items():
            w = scheme.get("weights") if isinstance(scheme, dict) else None
            if not isinstance(w, dict):
                refuse(f"config_groups.{name}.weights", w, supported)
            for key, want in (("num_bits", 4), ("type", "float"), ("group_size", GROUP)):
                if w.get(key, want) != want:
                    refuse(f"config_groups.{name}.weights.{key}", w[key], supported)
        return cls("modelopt")

    @classmethod
    def _compressed(cls, qc: dict, refuse) -> "Scheme":
        supported = (f"hetmoe reads compressed-tensors '{CT_FORMAT}' weights as NVFP4: type float, num_bits 4, "
                     f"strategy tensor_group, group_size {GROUP}, symmetric, weights stored (not dynamic)")
        groups = []
        for name, scheme, targets in config_groups(qc, CT_FORMAT, refuse, supported, unsupported=UNSUPPORTED,
                                                   activations=("output_activations",), activations_why=supported):
            at = f"config_groups.{name}"
            w = scheme.get("weights")
            if not isinstance(w, dict):
                refuse(f"{at}.weights", w, supported)
            for key, want in (("num_bits", 4), ("type", "float"), ("strategy", "tensor_group"),
                              ("group_size", GROUP), ("symmetric", True)):
                if w.get(key) != want:
                    refuse(f"{at}.weights.{key}", w.get(key), supported)
            if w.get("dynamic") not in (None, False):
                refuse(f"{at}.weights.dynamic", w["dynamic"], f"weights quantized at run time are not stored "
                                                              f"({supported})")
            if w.get("scale_dtype") not in (None, "torch.float8_e4m3fn"):
                refuse(f"{at}.weights.scale_dtype", w["scale_dtype"], "NVFP4 scales are E4M3")
            groups.append(Group(name, tuple(targets), GROUP))
        return cls("compressed-tensors", PackQuantized(tuple(groups), tuple(qc.get("ignore") or [])))


def read_modelopt_file(path: Path) -> dict:
    """ModelOpt's hf_quant_config.json (``{"producer": .., "quantization": {"quant_algo": .., "group_size": ..,
    "exclude_modules": ..}}``) as the quantization_config its newer exports write into config.json."""
    try:
        raw = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QuantizationConfigError(f"{path} is not valid JSON: {err}") from None
    quant = raw.get("quantization") if isinstance(raw, dict) else None
    if not isinstance(quant, dict):
        raise QuantizationConfigError(f"{path} has no \"quantization\" object (ModelOpt writes its quant_algo there)")
    return {**quant, "quant_method": "modelopt"}


def describes(qc) -> bool:
    """Whether quantization_config ``qc`` is one of the NVFP4 writers' (the ones Scheme.parse reads)."""
    return isinstance(qc, dict) and (qc.get("quant_method") == "modelopt" or (
        qc.get("quant_method") == "compressed-tensors" and qc.get("format") == CT_FORMAT))


@dataclass(frozen=True)
class FP4Weight:
    """One NVFP4 linear of the checkpoint: its module name, shape [N, K] and stored tensors (header entries)."""

    module: str
    shape: tuple
    codes: object  # uint8 [N, K / 2]
    scale: object  # float8_e4m3fn [N, K / 16]
    factor: object  # fp32, one value


def codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., N, K / 2] -> int8 E2M1 indices [.., N, K] (the low nibble of byte j is column 2j)."""
    return nibbles(packed).view(torch.int8)


def engine_scales(scale: torch.Tensor, factor: torch.Tensor, divides: bool, name: str) -> torch.Tensor:
    """The lut4 e2m1 scales fp32 [.., N, K / 16] of E4M3 ``scale`` and the matrix's fp32 ``factor``: the reference's
    one fp32 product (or quotient), halved. ValueError naming ``name`` for a value that is not finite or whose half
    fp32 does not hold."""
    f = factor.float().reshape(())
    s = scale.contiguous().view(torch.float8_e4m3fn).float()
    full = s / f if divides else s * f
    half = full * 0.5
    if not bool(torch.isfinite(full).all()):
        raise ValueError(f"{name}: its scales times its per-tensor factor {float(f)!r} are not all finite (an E4M3 "
                         "NaN, or a factor of 0, Inf or NaN)")
    if not torch.equal(half * 2, full):
        raise ValueError(f"{name}: scales below fp32's normal range (factor {float(f)!r}) do not halve exactly")
    return half


def dequantize(packed: torch.Tensor, scale: torch.Tensor, factor: torch.Tensor, divides: bool,
               name: str = "NVFP4 weight") -> torch.Tensor:
    """The values fp32 [N, K]: e2m1 codebook value x engine scale, bitwise the writer's reference."""
    book = torch.tensor(CODEBOOKS["e2m1"], dtype=torch.float32)
    s = engine_scales(scale, factor, divides, name)
    return (book[codes(packed).long()].unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2)


def held_scale_dtype(factors: list, divides: bool, plan: Optional[str] = None) -> str:
    """e4m3 (e4m3_div where the factor divides) for lut4 experts whose every factor f is positive with f * 2^7
    (f * 2^-7) a normal fp32; else (and for an int8 ``plan``) fp16 where every factor makes each E4M3 value's engine
    scale e4m3 * 2^j with j in FP16_EXPONENTS (a power of two factor), else fp32."""
    if codes_module.E4M3_HELD and plan != "int8" and factors and all(_e4m3_factor(f, divides) for f in factors):
        return "e4m3_div" if divides else "e4m3"
    for f in factors:
        mantissa, exponent = torch.frexp(torch.tensor(float(f), dtype=torch.float32))
        if float(mantissa) != 0.5:
            return "fp32"
        k = int(exponent) - 1  # f = 2^k
        if (-k if divides else k) - 1 not in FP16_EXPONENTS:
            return "fp32"
    return "fp32" if not factors else "fp16"


def _e4m3_factor(f: float, divides: bool) -> bool:
    """Whether e4m3 / e4m3_div scales hold factor ``f``: positive, its stored form f * 2^7 (f * 2^-7) a normal fp32."""
    stored = torch.tensor(f, dtype=torch.float32) * (2.0**-7 if divides else 2.0**7)
    return f > 0 and bool(torch.isfinite(stored)) and float(stored) >= torch.finfo(torch.float32).tiny


class FP4Linears:
    """The NVFP4 linears of one checkpoint by their model names (``<m>.weight``), found from the headers; the
    routed experts among them (``blocks``: "<block>.experts" prefixes) packed from their codes."""

    def __init__(self, scheme: Scheme, weights: dict, read: Callable, where: str):
        self.scheme, self.weights, self._read, self.where = scheme, weights, read, where
        self.blocks = {m[1] for m in (_EXPERT.fullmatch(n) for n in weights) if m is not None}
        self._dtypes: dict = {}  # (block prefix, plan) -> held scale dtypes (gate/up, down)

    @classmethod
    def find(cls, entries: dict, read: Callable, qc, where: str) -> Optional["FP4Linears"]:
        """The NVFP4 linears of ``entries`` (name -> header entry: .dtype, .shape, .shard, .raw), their parts
        taken out of ``entries``; None when quantization_config ``qc`` is not an NVFP4 one. QuantizationConfigError
        naming the setting, or the shard and tensor, that this reader does not handle."""
        if not describes(qc):
            return None
        scheme = Scheme.parse(qc, where)
        codes_part, scale_part, factor_part, act_part = PARTS[scheme.producer]
        if scheme.producer == "modelopt":
            modules = {n[:-len(".weight")] for n, e in entries.items() if n.endswith(".weight") and e.dtype ==
                       torch.uint8} | {n[:-len(".weight_scale_2")] for n in entries if n.endswith(".weight_scale_2")}
        else:
            modules = {n[:-len(".weight_packed")] for n in entries if n.endswith(".weight_packed")}
        weights = {}
        for m in sorted(modules):
            parts = {p: entries.get(f"{m}.{p}") for p in (codes_part, scale_part, factor_part)}
            shard = next(e for e in parts.values() if e is not None).shard
            stored = parts[codes_part].raw[:-len(codes_part) - 1] if parts[codes_part] is not None else m
            if scheme.targets is not None and scheme.targets.group_of(m, stored) is None:
                raise QuantizationConfigError(f"{shard}: {m}.{codes_part} is NVFP4, but {where}'s quantization_config "
                                              f"does not quantize {m} (no config group targets it, or ignore lists "
                                              "it)")
            weights[m + ".weight"] = _checked(m, parts, scheme.producer, shard, entries)
            for p in (codes_part, scale_part, factor_part, act_part, "weight_shape"):
                entries.pop(f"{m}.{p}", None)
        return cls(scheme, weights, read, where)

    def matrix(self, name: str) -> torch.Tensor:
        """The linear ``name`` dequantized, fp32 [N, K]."""
        w = self.weights[name]
        return dequantize(self._read(w.codes), self._read(w.scale), self._read(w.factor), self.scheme.divides, name)

    def _factors(self, prefix: str, which: str) -> list:
        out = []
        e = 0
        while f"{prefix}.experts.{e}.{which}.weight" in self.weights:
            out.append(float(self._read(self.weights[f"{prefix}.experts.{e}.{which}.weight"].factor).reshape(())))
            e += 1
        return out

    def scale_dtypes(self, prefix: str, names: list, plan: Optional[str] = None) -> tuple:
        """(gate/up, down) scale dtypes block ``prefix``'s experts are held in (each matrix's factor read; an int8
        ``plan``: the widened ones)."""
        key = (prefix, plan == "int8")
        if key not in self._dtypes:
            gu = self._factors(prefix, names[0]) + self._factors(prefix, names[1])
            self._dtypes[key] = (held_scale_dtype(gu, self.scheme.divides, plan),
                                 held_scale_dtype(self._factors(prefix, names[2]), self.scheme.divides, plan))
        return self._dtypes[key]

    def layout(self, prefix: str, names: list, plan: Optional[str] = None) -> dict:
        """The CPUExperts layout that holds block ``prefix``'s experts exactly: lut4 e2m1 group 16 (an int8 plan:
        their codebook values as int8 codes)."""
        fmt, book = ("int8", None) if plan == "int8" else ("lut4", "e2m1")
        return {"weight_format": fmt, "group_size": GROUP, "down_group_size": GROUP,
                "scaling": ("symmetric", "symmetric"), "scale_dtype": self.scale_dtypes(prefix, names, plan),
                "codebook": (book, book)}

    def load(self, prefix: str, names: list, experts) -> None:
        """Block ``prefix``'s experts packed from their nibbles and scales, CHUNK at a time. ValueError naming the
        expert and matrix stored otherwise or refused by the engine."""
        I, H = experts.intermediate_size, experts.hidden_size
        as_int8 = experts.info()["weight_format"] == "int8"
        for e0 in range(0, experts.num_experts, CHUNK):
            e1 = min(e0 + CHUNK, experts.num_experts)
            qs, ss, fs = [], [], []
            for which, shape in zip(names, ((I, H), (I, H), (H, I))):
                q, s, f = [], [], []
                for e in range(e0, e1):
                    name = f"{prefix}.experts.{e}.{which}.weight"
                    w = self.weights.get(name)
                    if w is None or w.shape != shape:
                        got = "not NVFP4" if w is None else f"NVFP4 {list(w.shape)}"
                        raise ValueError(f"{name} is {got}; the layer's experts are NVFP4 {list(shape)}")
                    q.append(codes(self._read(w.codes)))
                    factor = self._read(w.factor)
                    s.append(engine_scales(self._read(w.scale), factor, self.scheme.divides, name))
                    f.append(factor.float().reshape(()))
                q = torch.stack(q)
                qs.append(lut4_values(q, "e2m1") if as_int8 else q)
                ss.append(torch.stack(s))
                fs.append(torch.stack(f))  # read only where the scales are held e4m3 / e4m3_div
            try:
                load_codes(experts, qs, ss, first_expert=e0, scan_first=False, factors=fs)
            except ValueError as err:
                raise ValueError(f"{prefix}.experts {e0}..{e1 - 1}: {err}") from None

    def describe(self) -> str:
        who = ("compressed-tensors nvfp4-pack-quantized" if self.scheme.producer == "compressed-tensors"
               else "ModelOpt NVFP4")
        return f"{who} (E2M1 in groups of {GROUP}, E4M3 scales x a per-tensor fp32 factor)"

    def options(self, options, log: Callable[[str], None], file: str, layers: list, names: list):
        """``options`` with the experts format the experts load at by default: lut4 e2m1 group 16 (a plan's int4 of
        group 16), exactly; an explicit int4 / int8 of group 16 is exact too, anything else re-quantized as asked.
        ``layers``: the MoE blocks' prefixes (their held scale dtypes said)."""
        what = f"{file}'s routed experts are {self.describe()}"
        fmt = options.experts_format
        plan = "int8" if fmt == "int8" else None
        dtypes = sorted({d for p in layers if f"{p}.experts" in self.blocks
                         for d in self.scale_dtypes(p, names, plan)})
        held = f"{'/'.join(dtypes)} scales"

        if fmt == "auto":
            log(f"hetmoe: {what}: packed from their own codes as lut4 (e2m1) group {GROUP} with {held}, exactly")
            return dataclasses.replace(options, experts_format="int4", group_size=GROUP)
        if fmt in ("int4", "int8") and options.group_size in (None, GROUP):
            log(f"hetmoe: {what}: packed as {'lut4 (e2m1)' if fmt == 'int4' else 'int8'} group {GROUP} with {held} "
                "from their codes, exactly")
            return dataclasses.replace(options, group_size=GROUP)
        log(f"hetmoe: note: {what}: dequantized and re-quantized into {fmt} as asked")
        return options


_EXPERT = re.compile(r"(.*\.experts)\.\d+\.\w+\.weight")


def _checked(m: str, parts: dict, producer: str, shard, entries: dict) -> FP4Weight:
    """The FP4Weight ``parts`` (part name -> header entry or None) describe; QuantizationConfigError naming the
    shard and the tensor whose dtype or shape disagrees, or that is missing."""
    codes_part, scale_part, factor_part, _ = PARTS[producer]
    missing = [f"{m}.{p}" for p, e in parts.items() if e is None]
    if missing:
        have = next(f"{m}.{p}" for p, e in parts.items() if e is not None)
        raise QuantizationConfigError(f"{shard}: {have} has no {', '.join(missing)} beside it (NVFP4 linears are "
                                      f"{', '.join(parts)})")
    if f"{m}.weight_zero_point" in entries:
        raise QuantizationConfigError(f"{shard}: {m}.weight_zero_point: NVFP4 weights are symmetric (no zero point)")
    c, s, f = (parts[p] for p in (codes_part, scale_part, factor_part))
    if c.dtype != torch.uint8 or len(c.shape) != 2:
        raise QuantizationConfigError(f"{shard}: {m}.{codes_part} is {c.dtype} {list(c.shape)}; NVFP4 codes are "
                                      "uint8 [out, in / 2], two to a byte")
    N, K = c.shape[0], 2 * c.shape[1]
    if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != (N, K // GROUP) or K % GROUP:
        raise QuantizationConfigError(f"{shard}: {m}.{scale_part} is {s.dtype} {list(s.shape)}; {m}.{codes_part} "
                                      f"{list(c.shape)} holds [{N}, {K}], whose NVFP4 scales are float8_e4m3fn "
                                      f"[{N}, {K // GROUP}] (one per {GROUP} inputs)")
    numel = 1
    for d in f.shape:
        numel *= d
    if f.dtype != torch.float32 or numel != 1:
        raise QuantizationConfigError(f"{shard}: {m}.{factor_part} is {f.dtype} {list(f.shape)}; it must be one fp32 "
                                      "value (the per-tensor factor)")
    return FP4Weight(m, (N, K), c, s, f)
