"""How GPU-resident experts (hetmoe/moe/gpu_resident/experts.py) store their weights: bf16, or int8/int4 weight-only,
symmetric, one fp32 scale per ``group`` weights along K (32, 64 or 128) -- value = scale * q, the CPU engine's own
convention, so that resident experts of the CPU's format hold exactly the values its kernels multiply by; or lut4,
a CPU engine's lut4 codes kept as they are (codebook indices in int4's layout, value = scale * codebook[i]: the
bytes of int4, which is what a memory plan counts for those layers). Scales the CPU engine stores narrower than fp32
(fp16, bf16, e8m0, k8, k4) are widened to fp32 at upload, exactly (the int4 bytes a plan counts, again). The bit-plane
codes (int6, int5, int3, int2: GGUF's Q6_K, Q5_K, Q3_K, Q2_K) are widened exactly, int6 / int5 into int8 codes and
int3 / int2 into int4 codes, in the same group with the same scales: the resident kernels dequantize int8 and int4 in
their K loop (hetmoe/ops/triton/experts.py ``_halves``) and no kernel of theirs reads the packed planes. Affine
matrices (the K-quants Q4_K, Q5_K, Q2_K; Q4_1 / Q5_1) keep their mins beside the scales, fp32 too: value =
scale * u - min, u = q + 128 (int8) or the nibble (int4), rounded twice as the CPU engine rounds it (Q2_K's k4: scale =
sub-scale nibble x fp16 d, min = sub-min nibble x fp16 dmin, both exact in fp32; GPTQ / AWQ / compressed-tensors zero
points, fp16_zp / bf16_zp / fp32_zp: min = fl(scale x int8 zero point), as the CPU kernels widen it).

Layout of one quantized matrix stack (the conventions of hetmoe/ops/triton/linear.py, with the group a parameter;
K zero-padded to Kp, a multiple of the group):
* int8: codes int8 [R, Kp]; scales fp32 [R, Kp / group].
* int4: codes uint8 [R, Kp / 2]; in group g, byte i holds weight g*group + i in its low nibble and weight
  g*group + group/2 + i in its high nibble, each stored as q + 8 (q in [-8, 7]); scales fp32 [R, Kp / group].
  The two halves of a group are two contiguous slices of x, so a kernel needs no interleave.
* lut4: as int4, each nibble the codebook index itself (no offset); the codebook is the Storage's.
* affine int8 / int4: as above, u - 128 / u - 8 stored as q; mins fp32 [R, Kp / group] beside the scales.

``cpu_codes`` reads a CPU engine's codes and scales (and mins) out of its packed storage (hetmoe/moe/streamed/packed.py)
where the format matches (int8/int4/lut4, the bit-plane formats widened, grid blocks decoded into int8, one NUMA
slice); elsewhere ``quantize``
packs the engine's dequantized values afresh into int8/int4 (scale = max |w| of the group / qmax: 127 for int8, 7
for int4).

Shape letters: R rows (of all matrices stacked), K columns, Kp K padded, G groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from hetmoe.cpu.layout import CODEBOOKS

FORMATS = ("bf16", "int8", "int4")  # what --gpu-experts-format takes
STORED = FORMATS + ("lut4",)  # lut4: only a CPU engine's own lut4 codes, kept
GROUPS = (16, 32, 64, 128)
DEFAULT_GROUP = 64  # where the weights are quantized here (not the CPU engine's own codes)
QMAX = {"int8": 127, "int4": 7}
WIDENED = {"int6": "int8", "int5": "int8", "int3": "int4", "int2": "int4"}  # a bit-plane format's codes, held exactly
# grid (GGUF's i-quants): its blocks decoded at upload (hetmoe/moe/streamed/grid.py) into the int8 codes (|q| <= 63)
# and fp32 scales of its group that the CPU kernels multiply, exactly (cpu_codes); the resident kernels read no blocks
WIDENED["grid"] = "int8"
OFFSET = {"int8": 128, "int4": 8, "lut4": 0}  # u - q of a stored code (affine: the kernels add it back)


@dataclass(frozen=True)
class Storage:
    """The stored format of a layer's resident experts: gate/up's and down's format and scale group (groups are
    ignored for bf16)."""

    gate_up: str = "bf16"
    down: str = "bf16"
    group: int = DEFAULT_GROUP
    down_group: int = DEFAULT_GROUP
    gate_up_codebook: Optional[str] = None  # lut4's codebooks (hetmoe/cpu/layout.py CODEBOOKS)
    down_codebook: Optional[str] = None
    gate_up_affine: bool = False  # mins beside the scales: only a CPU engine's affine codes, kept
    down_affine: bool = False

    def __post_init__(self):
        for name, fmt, group, book, affine in (
                ("gate/up", self.gate_up, self.group, self.gate_up_codebook, self.gate_up_affine),
                ("down", self.down, self.down_group, self.down_codebook, self.down_affine)):
            if fmt not in STORED:
                raise ValueError(f"{name} storage must be one of {', '.join(FORMATS)}, got {fmt!r}")
            if fmt != "bf16" and group not in GROUPS:
                raise ValueError(f"{name} {fmt} scale group must be one of {GROUPS}, got {group!r}")
            if (fmt == "lut4") != (book is not None) or (book is not None and book not in CODEBOOKS):
                raise ValueError(f"{name} {fmt} storage with codebook {book!r}: lut4 needs one of "
                                 f"{', '.join(CODEBOOKS)}, other formats none")
            if affine and fmt not in QMAX:
                raise ValueError(f"{name} {fmt} storage cannot be affine (int8 and int4 can)")
        if (self.gate_up == "bf16") != (self.down == "bf16"):
            raise ValueError(f"resident experts are bf16 or int8/int4 throughout, not gate/up {self.gate_up} with "
                             f"down {self.down}")

    @classmethod
    def of(cls, fmt: str, group: int = DEFAULT_GROUP) -> "Storage":
        return cls(fmt, fmt, group, group)

    @property
    def name(self) -> str:
        """As the plan prints it: ``int4``, ``int4/int8`` (gate/up, down differ)."""
        return self.gate_up if self.gate_up == self.down else f"{self.gate_up}/{self.down}"

    @property
    def quantized(self) -> bool:
        return self.gate_up != "bf16" or self.down != "bf16"


def padded(k: int, group: int) -> int:
    return -(-k // group) * group


def matrix_bytes(fmt: str, rows: int, k: int, group: int, itemsize: int = 2, affine: bool = False) -> int:
    """Bytes of ``rows`` x ``k`` weights stored in ``fmt`` (bf16: ``itemsize`` per weight, the model dtype;
    ``affine``: mins beside the scales)."""
    if fmt == "bf16":
        return rows * k * itemsize
    kp = padded(k, group)
    return rows * (kp // (2 if fmt in ("int4", "lut4") else 1) + kp // group * 4 * (2 if affine else 1))


def expert_bytes(storage: Storage, hidden: int, intermediate: int, itemsize: int = 2) -> int:
    """Bytes one resident expert takes on the GPU: gate and up [I, H], down [H, I]."""
    return (matrix_bytes(storage.gate_up, 2 * intermediate, hidden, storage.group, itemsize, storage.gate_up_affine)
            + matrix_bytes(storage.down, hidden, intermediate, storage.down_group, itemsize, storage.down_affine))


def pack_int4(q: torch.Tensor, group: int, offset: int = 8) -> torch.Tensor:
    """int codes in [-8, 7] (lut4: indices 0..15, offset 0), [R, Kp] -> uint8 [R, Kp / 2] (the layout above)."""
    R, kp = q.shape
    u = (q.to(torch.int16) + offset).view(R, kp // group, 2, group // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).to(torch.uint8).view(R, kp // 2)


def unpack_int4(packed: torch.Tensor, group: int, offset: int = 8) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [R, Kp / 2] -> int8 codes [R, Kp]."""
    R, half = packed.shape
    b = packed.to(torch.int16).view(R, half * 2 // group, 1, group // 2)
    return (torch.cat([b & 15, b >> 4], dim=2) - offset).to(torch.int8).view(R, half * 2)


def encode(q: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """int codes [R, Kp] (lut4: codebook indices) -> the stored codes of ``fmt``."""
    if fmt == "int8":
        return q.to(torch.int8)
    return pack_int4(q, group, 0 if fmt == "lut4" else 8)


def quantize(w: torch.Tensor, fmt: str, group: int) -> tuple:
    """fp32 ``w`` [R, K] -> (codes, fp32 scales [R, Kp / group]), symmetric: scale = max |w| of the group / qmax."""
    if fmt not in QMAX:
        raise ValueError(f"resident experts quantize into int8 or int4, not {fmt} (lut4 keeps a CPU engine's codes)")
    R, K = w.shape
    kp = padded(K, group)
    g = F.pad(w.float(), (0, kp - K)).view(R, kp // group, group)
    scale = g.abs().amax(-1) / QMAX[fmt]  # [R, G]
    q = torch.round(g / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-QMAX[fmt], QMAX[fmt])
    return encode(q.view(R, kp), fmt, group), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, group: int, k: int,
               dtype: torch.dtype = torch.float32, codebook: Optional[str] = None,
               mins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stored ``codes``/``scales`` of ``fmt`` -> [R, k] in ``dtype`` (scale * q in fp32, then rounded to ``dtype``;
    lut4: q = ``codebook``'s value of each index; ``mins``: affine, scale * u - min with u = q + OFFSET, two
    roundings)."""
    if fmt == "lut4":
        from hetmoe.moe.streamed.packed import codebook_values

        q = codebook_values(codebook, codes.device)[unpack_int4(codes, group, 0).long()]
    else:
        q = unpack_int4(codes, group) if fmt == "int4" else codes
    R, kp = q.shape
    if mins is not None:
        u = q.float().view(R, kp // group, group) + OFFSET[fmt]
        w = u * scales.float().unsqueeze(-1) - mins.float().unsqueeze(-1)
    else:
        w = q.float().view(R, kp // group, group) * scales.float().unsqueeze(-1)
    return w.view(R, kp)[:, :k].to(dtype)


# ------------------------------------------------------------------------------------ the CPU engine's own codes


def _group(cpu_group: int) -> int:
    """The resident group that holds a CPU group's codes: itself, 128 for per-row int8/int4 (0: the row's scale
    repeated), the default for a group the GPU kernels do not take."""
    return 128 if not cpu_group else cpu_group if cpu_group in GROUPS else DEFAULT_GROUP


def planned_storage(fmt: str, cpu_format: str, cpu_group: int, layout: Optional[dict] = None) -> Storage:
    """The storage ``--gpu-experts-format fmt`` gives experts whose CPU format is ``cpu_format`` in ``cpu_group``
    (before any weight exists: the memory plan): auto is the CPU format; int8/int4 of the CPU's format keep its group
    (its codes), another format takes the default group. ``layout``: the CPU experts' layout as the loader builds it
    (CPUExperts' keyword arguments: each matrix's format, group, scaling, codebook), so that the storage is the one
    ``storage_for`` gives them (a whole layer: its codes copied; affine matrices with their fp32 mins)."""
    if fmt not in ("auto",) + FORMATS:
        raise ValueError(f"GPU experts format must be auto or one of {', '.join(FORMATS)}, got {fmt!r}")
    if layout is not None and fmt != "bf16":
        fmts, books, scalings = (tuple(v) if isinstance(v, (tuple, list)) else (v, v) for v in (
            layout["weight_format"], layout.get("codebook"), layout.get("scaling", "symmetric")))
        groups = (layout["group_size"] or 0, layout.get("down_group_size") or layout["group_size"] or 0)
        if "bf16" in fmts or "fp8" in fmts:  # no GPU kernels for fp8: its values in bf16
            return Storage.of("bf16") if fmt == "auto" else Storage.of(fmt)
        if fmt == "auto":  # cpu_storage's, the NUMA split aside
            out = [("int4", g, None, False) if f == "lut4" and g not in GROUPS else
                   (WIDENED.get(f, f), g, b if f == "lut4" else None, g in GROUPS and s == "affine")
                   for f, g, b, s in zip(fmts, groups, books, scalings)]
            (gu, g, gb, ga), (dn, dg, db, da) = out
            return Storage(gu, dn, _group(g), _group(dg), gb, db, ga, da)
        gu, dn = (WIDENED.get(f, f) for f in fmts)  # storage_for's
        return Storage(fmt, fmt, _group(groups[0]) if gu == fmt else DEFAULT_GROUP,
                       _group(groups[1]) if dn == fmt else DEFAULT_GROUP)
    cpu_format = WIDENED.get(cpu_format, cpu_format)  # bit-plane codes: held as int8 / int4
    if fmt == "auto":
        fmt = "bf16" if cpu_format == "fp8" else cpu_format  # fp8: no GPU kernels for it; its values in bf16
    if fmt == "bf16":
        return Storage.of("bf16")
    return Storage.of(fmt, _group(cpu_group) if fmt == cpu_format else DEFAULT_GROUP)


def cpu_storage(cpu_experts) -> Storage:
    """The Storage that holds a CPUExperts' values exactly: its formats and groups (per-row int8/int4: a group of 128,
    the row's scale repeated; a group the GPU kernels do not take: the default; bit-plane codes widened into int8 /
    int4), lut4 with its codebooks, affine matrices with their mins. lut4 codes and affine mins are only copied, never
    made here: a matrix that cpu_codes cannot copy (a NUMA-split layer, a group the GPU kernels do not take) is stored
    as symmetric int8 / int4 (lut4: int4, the same bytes), re-quantized from the engine's values."""
    info = cpu_experts.info()
    if {"bf16", "fp8"} & {info["weight_format"], info["down_weight_format"]}:  # fp8: no GPU kernels; its values
        return Storage.of("bf16")
    whole = info.get("numa_subpools", 1) == 1
    out = []
    for fmt, group, book, scaling in (
            (info["weight_format"], info["group_size"] or 0, info["gate_up_codebook"], info["gate_up_scaling"]),
            (info["down_weight_format"], info["down_group_size"] or 0, info["down_codebook"], info["down_scaling"])):
        copied = whole and group in GROUPS  # (per-row codes, group 0, are copied too, as symmetric group 128)
        if fmt == "lut4" and not copied:
            fmt, book = "int4", None
        book = book if fmt == "lut4" else None  # (grid's type)
        fmt = WIDENED.get(fmt, fmt)  # bit-plane codes: widened exactly (cpu_codes)
        out.append((fmt, _group(group), book, copied and scaling == "affine"))
    (gu, g, gb, ga), (dn, dg, db, da) = out
    return Storage(gu, dn, g, dg, gb, db, ga, da)


def storage_for(cpu_experts, fmt: str = "auto") -> Storage:
    """The storage of resident experts taken from a CPUExperts: ``auto`` its own formats (``cpu_storage``);
    ``bf16``; ``int8``/``int4`` in the engine's group where its matrix has that format (its codes are kept), else
    in the default group."""
    if fmt == "auto":
        return cpu_storage(cpu_experts)
    if fmt not in FORMATS:
        raise ValueError(f"GPU experts format must be auto or one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "bf16":
        return Storage.of("bf16")
    info = cpu_experts.info()
    gu, dn = (WIDENED.get(info[key], info[key]) for key in ("weight_format", "down_weight_format"))
    return Storage(fmt, fmt, _group(info["group_size"] or 0) if gu == fmt else DEFAULT_GROUP,
                   _group(info["down_group_size"] or 0) if dn == fmt else DEFAULT_GROUP)


def cpu_codes(cpu_experts, expert: int, storage: Storage, ranges: Optional[list] = None,
              device=None) -> Optional[tuple]:
    """((gate_up codes, scales), (down codes, scales)) of ``expert`` in ``storage``'s layout -- (codes, scales, mins)
    for a matrix ``storage`` holds affine -- read from the CPU engine's packed bytes (``ranges``:
    hetmoe.moe.streamed.packed.expert_ranges, or read here) and converted on ``device`` (default: the CPU; a GPU does
    it in well under a millisecond, the CPU in a few hundred), the scales (and mins) widened to fp32 (exact),
    bit-plane codes widened into int8 / int4 and grid blocks decoded into int8 (exact); an entry is None where the
    engine's matrix is not exactly that (another format, group, codebook or scaling, bf16 or fp8, a NUMA-split
    layer)."""
    from hetmoe.moe.streamed import grid, packed

    info = cpu_experts.info()
    if info.get("numa_subpools", 1) != 1 or info["weight_format"] == "fp8":
        return None, None
    layout = packed.ExpertLayout.of(cpu_experts)
    ranges = packed.expert_ranges(cpu_experts) if ranges is None else ranges
    if layout.fmt == "bf16":
        return None, None
    given = iter(ranges)  # (storage() leaves empty ranges out: IQ1_M's d)
    parts = [next(given)[expert * s:(expert + 1) * s].to(device or "cpu") if s else None for s in layout.range_bytes()]
    I, H = layout.intermediate, layout.hidden
    out = []
    for shape, data, scales, fmt, group, book, affine, n_mats, n in (
            (layout.gate_up, parts[0], parts[1], storage.gate_up, storage.group, storage.gate_up_codebook,
             storage.gate_up_affine, 2, I),
            (layout.down, parts[2], parts[3], storage.down, storage.down_group, storage.down_codebook,
             storage.down_affine, 1, H)):
        if (shape.affine != affine or WIDENED.get(shape.fmt, shape.fmt) != fmt or shape.group != group
                or (shape.codebook != book and shape.fmt != "grid")):
            out.append(None)
            continue
        if shape.fmt == "grid":  # the blocks decoded: int8 codes and fp32 scales in the type's group, rows in order
            blocks, d = grid.engine_rows(data, scales, shape.codebook, shape.n_blocks, shape.kp, n_mats, n)
            out.append(grid.decode(blocks, d, shape.codebook))
            continue
        nb, G = shape.n_blocks, shape.kp // shape.group
        # gate and up row blocks alternate (block 2 rb + m is matrix m's rb): [n_mats, NB * 16, Kp] in row order
        codes = packed._unpack_data(data, shape, n_mats).view(nb, n_mats, packed.ROWS, shape.kp)
        codes = codes.transpose(0, 1).reshape(n_mats * nb * packed.ROWS, shape.kp)
        widened = packed.widen_sets(scales.view(nb * n_mats, shape.block_scale_bytes), shape)  # (scales, mins)

        def per_row(j: int) -> torch.Tensor:  # widened j (0: scales, 1: mins) as fp32 [n_mats * n, G]
            v = widened[j].view(nb, n_mats, G, packed.ROWS).permute(1, 0, 3, 2)
            return v.reshape(n_mats, nb * packed.ROWS, G)[:, :n].reshape(n_mats * n, G).clone()

        # q = u - the stored offset: symmetric codes' own (2^(b-1) of a b-bit code), affine int8 / int4's (added back)
        codes = codes.view(n_mats, nb * packed.ROWS, shape.kp)[:, :n].reshape(n_mats * n, shape.kp)
        codes = codes - (OFFSET[fmt] if affine else shape.offset if fmt != "lut4" else 0)
        out.append((encode(codes, fmt, group), per_row(0)) + ((per_row(1),) if affine else ()))
    return tuple(out)
