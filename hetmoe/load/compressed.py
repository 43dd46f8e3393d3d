"""Checkpoints quantized by compressed-tensors in its ``pack-quantized`` format, as Kimi-K2.5 / K2.6 (and
Kimi-K2-Thinking) ship their routed experts: int4 weights, symmetric, one scale per group of 32 along the input.

One quantized linear ``<m>`` of shape [out, in] is stored as three tensors (compressed-tensors'
PackedQuantizationCompressor):

    <m>.weight_packed   int32 [out, in / 8]: eight codes per word, column 8w + j in bits 4j..4j+3 of word w, each
                        code stored as q + 8 (q in [-8, 7]); the words are little-endian, so byte b of a row holds
                        column 2b in its low nibble and column 2b + 1 in its high one
    <m>.weight_scale    bf16 / fp16 / fp32 [out, in / group]
    <m>.weight_shape    int [2]: (out, in)

and means ``w[r, c] = q[r, c] * scale[r, c // group]`` (no zero point). The CPU engine's int4 symmetric format holds
exactly this: the codes as they are and each scale in the file's own dtype (bf16 or fp16 scales are stored as such,
fp32 ones as fp32; ``held_scale_dtype`` is the one place that chooses it).

Asymmetric int4 (``symmetric: false``, llm-compressor's W4A16_ASYM) adds a zero point zp in [-8, 7] per group,
``w[r, c] = (q[r, c] - zp[r, c // group]) * scale[r, c // group]``, stored as

    <m>.weight_zero_point  int32 [ceil(out / 8), in / group]: packed along the rows (compressed-tensors'
                           pack_to_int32(packed_dim=0)): row 8w + j of a column in bits 4j.. of word w, stored zp + 8
                           (or, as older writers left it, int8 [out, in / group] unpacked)

which the engine's int4 affine format holds exactly as u = q + 8 in 0..15, value = scale * u - min with
min = scale * z, z = zp + 8: the scales in the file's dtype and each z as one int8 byte (scale dtype bf16_zp /
fp16_zp / fp32_zp, csrc/formats/layout.h: the kernels compute min = fl(scale * z), exact for bf16 and fp16 scales),
so a group costs its scale and one byte, as in the file but for half a byte.

``quantization_config`` names which modules are quantized (``config_groups`` -> targets, less ``ignore``) and how; a
setting this reader does not handle is refused by name (``PackQuantized.parse``) before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

GROUPS = (32, 64, 128)  # the int4 scale groups the CPU engine holds (hetmoe/cpu/experts.py)
ENGINE_SCALE_DTYPE = torch.float32  # the scales as load_codes takes them (whatever the engine then stores them as)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # each widens to fp32 exactly
SHAPE_DTYPES = (torch.int32, torch.int64)
PARTS = ("weight_packed", "weight_scale", "weight_shape")  # the tensors of one quantized linear, beside <m>.
ZERO_POINT = "weight_zero_point"  # beside them when asymmetric
_FORMAT = "pack-quantized"


class QuantizationConfigError(ValueError):
    """A quantization_config (or a quantized tensor) this reader does not handle; the message names the setting."""


@dataclass(frozen=True)
class Group:
    """One entry of quantization_config.config_groups: the modules it quantizes, its group size and whether it has
    zero points."""

    name: str
    targets: tuple  # "Linear" (every linear), "re:<regex>" (re.match on the module name), or a module name
    group_size: int
    symmetric: bool = True

    def matches(self, names: tuple) -> bool:
        return any(_match(n, t) for n in names for t in self.targets)


def _match(name: str, target: str) -> bool:
    """compressed-tensors' rule for names: a ``re:`` target matches from the start of the name, any other the whole
    name; ``Linear`` (the class every quantized module of a checkpoint is) matches every name."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass(frozen=True)
class PackQuantized:
    """A compressed-tensors quantization_config that this reader handles: int4, symmetric or with zero points, per
    group, stored ``pack-quantized``, weights only."""

    groups: tuple  # of Group, in config order (the first that targets a module quantizes it)
    ignore: tuple  # module names and re: patterns left unquantized

    def group_of(self, *names: str) -> Optional[Group]:
        """The config group quantizing the module known by ``names`` (its name in the model and in the file), or
        None when no group targets it or ``ignore`` leaves it out."""
        if any(_match(n, t) for n in names for t in self.ignore):
            return None
        return next((g for g in self.groups if g.matches(names)), None)

    @classmethod
    def parse(cls, qc, where: str = "config.json") -> "PackQuantized":
        """``qc`` (config.json's quantization_config) checked setting by setting; QuantizationConfigError naming the
        first one this reader does not handle (``where``: the file, for the message)."""
        if not isinstance(qc, dict):
            raise QuantizationConfigError(f"{where}: the checkpoint holds pack-quantized tensors (*.weight_packed) "
                                          f"but quantization_config is {qc!r}; it must describe them")

        def refuse(setting: str, value, why: str):
            raise QuantizationConfigError(f"{where}: quantization_config.{setting} is {value!r}; {why}")

        supported = (f"hetmoe reads compressed-tensors '{_FORMAT}' weights: int4 (type int, num_bits 4), symmetric or "
                     f"not, strategy group with group_size {' / '.join(map(str, GROUPS))}, weights only")
        groups = []
        for name, scheme, targets in config_groups(
                qc, _FORMAT, refuse, supported, unsupported=("kv_cache_scheme",) + UNSUPPORTED,
                activations=("input_activations", "output_activations"),
                activations_why=f"activation quantization is not run ({supported})"):
            group = _check_weights(scheme.get("weights"), f"config_groups.{name}.weights", refuse, supported)
            groups.append(Group(name, tuple(targets), group, scheme["weights"]["symmetric"]))
        ignore = qc.get("ignore") or []
        return cls(tuple(groups), tuple(ignore))


# settings no compressed-tensors reader of hetmoe runs
UNSUPPORTED = ("sparsity_config", "transform_config", "moe_sparsity_config")


def config_groups(qc: dict, fmt: str, refuse, supported: str, *, unsupported: tuple, activations: tuple,
                  activations_why: str):
    """The envelope of a compressed-tensors quantization_config whose groups are all stored as ``fmt`` (the top
    format, or "mixed-precision" with each group's own), checked setting by setting (``refuse(setting, value, why)``
    raises; ``supported`` says what the reader takes): quant_method, format, quantization_status, the ``unsupported``
    settings (None or {} only), ``ignore`` (a list of names and re: patterns that compile). Then, scheme by scheme,
    its format, the ``activations`` keys (None only; else ``activations_why``) and its targets -> yields
    (name, scheme, targets), the caller checking the scheme's weights before the next one."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        refuse("quant_method", method, supported)
    top_format = qc.get("format")
    if top_format not in (fmt, "mixed-precision", None):
        refuse("format", top_format, supported)
    status = qc.get("quantization_status")
    if status not in (None, "compressed", "frozen"):
        refuse("quantization_status", status, "hetmoe reads checkpoints saved compressed")
    for key in unsupported:
        if qc.get(key):  # None or {} (what compressed-tensors writes when there is none)
            refuse(key, qc[key], f"hetmoe runs none ({supported})")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        refuse("ignore", ignore, "it must be a list of module names and re: patterns")
    for t in ignore:
        _check_pattern(t, "ignore", refuse)
    raw_groups = qc.get("config_groups")
    if not isinstance(raw_groups, dict) or not raw_groups:
        refuse("config_groups", raw_groups, "it must map group names to their schemes")
    for name, scheme in raw_groups.items():
        at = f"config_groups.{name}"
        if not isinstance(scheme, dict):
            refuse(at, scheme, "a scheme is an object with targets and weights")
        own = scheme.get("format")
        if own not in (None, fmt) or (own is None and top_format != fmt):
            refuse(f"{at}.format" if own is not None else "format", own if own is not None else top_format,
                   supported)
        for key in activations:
            if scheme.get(key) is not None:
                refuse(f"{at}.{key}", scheme[key], activations_why)
        targets = scheme.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            refuse(f"{at}.targets", targets, "it must be a non-empty list of module names, re: patterns or Linear")
        for t in targets:
            _check_pattern(t, f"{at}.targets", refuse)
        yield name, scheme, targets


def _check_pattern(target: str, setting: str, refuse) -> None:
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as err:
            refuse(setting, target, f"its pattern does not compile ({err})")


def _check_weights(w, at: str, refuse, supported: str) -> int:
    """The group size of a weights scheme this reader handles (else refused naming the setting)."""
    if not isinstance(w, dict):
        refuse(at, w, supported)
    wants = (("type", "int"), ("num_bits", 4), ("strategy", "group"))
    for key, want in wants:
        if w.get(key) != want:
            refuse(f"{at}.{key}", w.get(key), supported)
    if not isinstance(w.get("symmetric"), bool):
        refuse(f"{at}.symmetric", w.get("symmetric"), "it must be true or false")
    group = w.get("group_size")
    if group not in GROUPS:
        refuse(f"{at}.group_size", group, f"the CPU engine's int4 holds groups of {' / '.join(map(str, GROUPS))}")
    if w.get("dynamic") not in (None, False):
        refuse(f"{at}.dynamic", w["dynamic"], f"weights quantized at run time are not stored ({supported})")
    if w.get("actorder") not in (None, False, "weight"):  # "weight": a calibration order, nothing stored
        refuse(f"{at}.actorder", w["actorder"], "activation-ordered groups (a g_idx per column) are not read")
    if w.get("block_structure") is not None:
        refuse(f"{at}.block_structure", w["block_structure"], supported)
    scale_dtype = w.get("scale_dtype")
    if scale_dtype not in (None, "torch.bfloat16", "torch.float16", "torch.float32"):
        refuse(f"{at}.scale_dtype", scale_dtype, "scales are read from bf16, fp16 or fp32")
    if w.get("zp_dtype") not in (None, "torch.int8", "torch.int32"):
        refuse(f"{at}.zp_dtype", w["zp_dtype"], "zero points are read as integers")
    return group


@dataclass(frozen=True)
class PackedWeight:
    """An int4 linear of the checkpoint, stored by compressed-tensors (``method`` "compressed-tensors"), GPTQ or AWQ
    (hetmoe/load/gptq.py): its module name (as the model names it), shape, the group the engine holds its scales in
    and how the file stores them."""

    module: str
    shape: tuple  # (out, in)
    group_size: int  # the engine's group: the file's, or a divisor of it (GPTQ's per-channel and larger groups)
    scale_dtype: torch.dtype  # as stored
    symmetric: bool = True  # False: a zero point per group (held int4 affine, the file's scales and int8 zero points)
    method: str = "compressed-tensors"
    file_group: Optional[int] = None  # the file's group when not group_size (GPTQ / AWQ)
    zeros_minus_one: bool = False  # GPTQ v1's zero points
    zeros_packed: bool = True  # compressed-tensors' zero points: packed int32 words (else int8)
    per_channel: bool = False  # GPTQ / AWQ group_size -1: one group of all inputs

    @property
    def stored_group(self) -> int:
        return self.file_group or self.group_size

    @property
    def held_scale_dtype(self) -> str:
        """The scale dtype the engine holds this weight's scales (and mins) in: the file's scale dtype; an affine
        weight's mins (a scale times a 4-bit zero point) as one int8 zero point each beside them (fp16_zp,
        bf16_zp, fp32_zp)."""
        return held_scale_dtype(self.scale_dtype) + ("" if self.symmetric else "_zp")

    def describe(self) -> str:
        what = {"compressed-tensors": "compressed-tensors pack-quantized int4", "gptq": "GPTQ int4",
                "awq": "AWQ (gemm) int4"}[self.method]
        per = "per output channel" if self.per_channel else f"per group of {self.stored_group}"
        kind = "symmetric" if self.symmetric else "with zero points"
        return f"{what} ({kind}, {str(self.scale_dtype).replace('torch.', '')} scales {per})"


def engine_group(group: int) -> Optional[int]:
    """The largest of the engine's int4 groups (GROUPS) dividing a file's ``group`` (its scales repeated in each),
    or None."""
    return next((g for g in reversed(GROUPS) if group % g == 0), None)


def check_parts(module: str, parts: dict, group: Group) -> PackedWeight:
    """``parts``: PARTS name -> (dtype, shape) of the module's stored tensors (headers only). The PackedWeight they
    describe, or QuantizationConfigError naming the tensor whose dtype or shape disagrees."""
    missing = [p for p in PARTS if p not in parts]
    if missing:
        raise QuantizationConfigError(f"{module}.weight_packed has no {', '.join(f'{module}.{p}' for p in missing)} "
                                      "beside it")
    (pdt, pshape), (sdt, sshape), (hdt, hshape) = (parts[p] for p in PARTS)
    if pdt != torch.int32 or len(pshape) != 2:
        raise QuantizationConfigError(f"{module}.weight_packed is {pdt} {list(pshape)}; int4 codes are packed eight "
                                      "to an int32, [out, in / 8]")
    if hdt not in SHAPE_DTYPES or tuple(hshape) != (2,):
        raise QuantizationConfigError(f"{module}.weight_shape is {hdt} {list(hshape)}; it must hold (out, in) as "
                                      "integers")
    if sdt not in SCALE_DTYPES:
        raise QuantizationConfigError(f"{module}.weight_scale has dtype {sdt}; scales are read from bf16, fp16 or "
                                      "fp32")
    out, cols = pshape[0], pshape[1] * 8
    g = group.group_size
    if tuple(sshape) != (out, cols // g) or cols % g:
        raise QuantizationConfigError(f"{module}.weight_scale has shape {list(sshape)}; {module}.weight_packed "
                                      f"{list(pshape)} holds [{out}, {cols}], which in groups of {g} "
                                      f"(quantization_config.config_groups.{group.name}) needs [{out}, {cols // g}]")
    zero = parts.get(ZERO_POINT)
    if group.symmetric:
        return PackedWeight(module, (out, cols), g, sdt)
    if zero is None:
        raise QuantizationConfigError(f"{module}.weight_packed has no {module}.{ZERO_POINT} beside it; quantization_"
                                      f"config.config_groups.{group.name} is asymmetric (symmetric false)")
    zdt, zshape = zero
    packed = (-(-out // 8), cols // g)
    unpacked = (out, cols // g)
    if not ((zdt == torch.int32 and tuple(zshape) == packed) or (zdt == torch.int8 and tuple(zshape) == unpacked)):
        raise QuantizationConfigError(f"{module}.{ZERO_POINT} is {zdt} {list(zshape)}; the zero points of [{out}, "
                                      f"{cols}] in groups of {g} are int32 {list(packed)} (packed along the rows) or "
                                      f"int8 [{out}, {cols // g}]")
    return PackedWeight(module, (out, cols), g, sdt, symmetric=False, zeros_packed=zdt == torch.int32)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2 * bytes] of ``packed``'s bytes [..., bytes] (any dtype, contiguous bytes: int32 words read
    little-endian): the low nibble of byte i at 2i, the high one at 2i + 1."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def unpack_zero_points(stored: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero points zp + 8 (uint8 0..15) [rows, groups] of a weight_zero_point: int32 [ceil(rows / 8), groups] packed
    along the rows, or int8 [rows, groups] holding zp itself."""
    if stored.dtype == torch.int8:
        return (stored.to(torch.int16) + 8).to(torch.uint8)
    return nibbles(stored.t())[:, :rows].t()  # [groups, 8 * words]: byte i holds rows 2i, 2i + 1


def check_shape(pw: PackedWeight, stored: torch.Tensor) -> None:
    """QuantizationConfigError unless ``stored`` (the module's weight_shape tensor) says the shape the packed codes
    and scales hold."""
    got = tuple(int(v) for v in stored.tolist())
    if got != pw.shape:
        raise QuantizationConfigError(f"{pw.module}.weight_shape says {list(got)}; its codes and scales hold "
                                      f"{list(pw.shape)}")


def unpack_int4(packed: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes q in [-8, 7], int8 [..., 8 * words], of pack-quantized int32 words [..., words] (written into ``out``
    when given)."""
    nibbles = packed.contiguous().view(torch.uint8)  # [..., 4 * words]: byte b holds columns 2b, 2b + 1
    shape = (*nibbles.shape[:-1], 2 * nibbles.shape[-1])
    if out is None:
        out = torch.empty(shape, dtype=torch.int8)
    elif tuple(out.shape) != shape or out.dtype != torch.int8:
        raise ValueError(f"unpack_int4: out must be int8 {list(shape)}, got {out.dtype} {list(out.shape)}")
    pairs = out.view(torch.uint8).view(*nibbles.shape, 2)
    torch.bitwise_and(nibbles, 0x0F, out=pairs[..., 0])
    torch.bitwise_right_shift(nibbles, 4, out=pairs[..., 1])
    out.sub_(8)
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_int4: int8 codes in [-8, 7], [..., cols] with cols a multiple of 8 -> int32 words
    [..., cols / 8], as compressed-tensors packs them."""
    if codes.dtype != torch.int8 or codes.shape[-1] % 8:
        raise ValueError(f"pack_int4 takes int8 codes [..., 8 * n], got {codes.dtype} {list(codes.shape)}")
    if codes.numel() and not (-8 <= int(codes.min()) and int(codes.max()) <= 7):
        raise ValueError("pack_int4 takes codes in [-8, 7]")
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(*codes.shape[:-1], -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous().view(torch.int32)


def held_scale_dtype(stored: torch.dtype) -> str:
    """The scale dtype the CPU engine holds a checkpoint's ``stored`` scales in: the file's own bf16 or fp16 (its
    bytes exactly: int4 group 32 is 4.5 bits a weight, as in the file), fp32 for fp32 scales."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(stored, "fp32")


def engine_scales(scale: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A checkpoint's scales as the engine's int4 format takes them (ENGINE_SCALE_DTYPE; widening is exact)."""
    if out is None:
        return scale.to(ENGINE_SCALE_DTYPE)
    return out.copy_(scale)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group: int, mins: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """w = q * scale (``mins``: u * scale - min) per group of ``group`` columns, fp32 [..., out, in]: exact for bf16
    and fp16 scales (a 4-bit code times 8 or 11 significant bits fits fp32's 24; scale * u and min = scale * z are
    multiples of the scale's last bit whose difference has at most 15 significant bits), one fp32 rounding for fp32
    scales."""
    w = codes.float().unflatten(-1, (-1, group)) * scale.float().unsqueeze(-1)
    if mins is not None:
        w = w - mins.float().unsqueeze(-1)
    return w.flatten(-2)


_FLOAT_FORMAT = "float-quantized"


@dataclass(frozen=True)
class FloatQuantized:
    """A compressed-tensors quantization_config of FP8 weights stored ``float-quantized`` that this reader handles:
    e4m3 (type float, num_bits 8), symmetric, one scale per output channel (``<m>.weight_scale`` [out, 1] beside the
    float8 ``<m>.weight``: hetmoe/load/fp8_formats.py "channel"); activations unquantized or quantized at run time
    (dynamic: nothing stored; hetmoe computes them unquantized)."""

    ignore: tuple

    @classmethod
    def parse(cls, qc, where: str = "config.json") -> "FloatQuantized":
        """``qc`` checked setting by setting; QuantizationConfigError naming the first one not handled."""
        def refuse(setting: str, value, why: str):
            raise QuantizationConfigError(f"{where}: quantization_config.{setting} is {value!r}; {why}")

        supported = (f"hetmoe reads compressed-tensors '{_FLOAT_FORMAT}' weights as FP8 e4m3 (type float, num_bits 8), "
                     "symmetric, strategy channel, with dynamic or no activation quantization")
        static = f"static activation scales are not read ({supported})"
        for name, scheme, _ in config_groups(qc, _FLOAT_FORMAT, refuse, supported,
                                             unsupported=("kv_cache_scheme",) + UNSUPPORTED,
                                             activations=("output_activations",), activations_why=static):
            at = f"config_groups.{name}"
            w = scheme.get("weights")
            if not isinstance(w, dict):
                refuse(f"{at}.weights", w, supported)
            for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True), ("strategy", "channel")):
                if w.get(key) != want:
                    refuse(f"{at}.weights.{key}", w.get(key), supported)
            if w.get("dynamic") not in (None, False):
                refuse(f"{at}.weights.dynamic", w["dynamic"], f"weights quantized at run time are not stored "
                                                              f"({supported})")
            a = scheme.get("input_activations")  # dynamic only: nothing stored
            if a is not None and (not isinstance(a, dict) or a.get("dynamic") is not True):
                refuse(f"{at}.input_activations", a, static)
        ignore = qc.get("ignore") or []
        return cls(tuple(ignore))
