"""How GPU-resident experts (hetmoe/moe/gpu_resident/experts.py) store their weights: bf16, or int8/int4 weight-only,
symmetric, one fp32 scale per ``group`` weights along K (32, 64 or 128) -- value = scale * q, the CPU engine's own
convention, so that resident experts of the CPU's format hold exactly the values its kernels multiply by.

Layout of one quantized matrix stack (the conventions of hetmoe/ops/triton/linear.py, with the group a parameter;
K zero-padded to Kp, a multiple of the group):
* int8: codes int8 [R, Kp]; scales fp32 [R, Kp / group].
* int4: codes uint8 [R, Kp / 2]; in group g, byte i holds weight g*group + i in its low nibble and weight
  g*group + group/2 + i in its high nibble, each stored as q + 8 (q in [-8, 7]); scales fp32 [R, Kp / group].
  The two halves of a group are two contiguous slices of x, so a kernel needs no interleave.

``cpu_codes`` reads a CPU engine's codes and scales out of its packed storage (hetmoe/moe/streamed/packed.py) where the
format matches (symmetric int8/int4, one NUMA slice); elsewhere ``quantize`` packs the engine's dequantized values
afresh (scale = max |w| of the group / qmax: 127 for int8, 7 for int4).

Shape letters: R rows (of all matrices stacked), K columns, Kp K padded, G groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

FORMATS = ("bf16", "int8", "int4")
GROUPS = (32, 64, 128)
DEFAULT_GROUP = 64  # where the weights are quantized here (not the CPU engine's own codes)
QMAX = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class Storage:
    """The stored format of a layer's resident experts: gate/up's and down's format and scale group (groups are
    ignored for bf16)."""

    gate_up: str = "bf16"
    down: str = "bf16"
    group: int = DEFAULT_GROUP
    down_group: int = DEFAULT_GROUP

    def __post_init__(self):
        for name, fmt, group in (("gate/up", self.gate_up, self.group), ("down", self.down, self.down_group)):
            if fmt not in FORMATS:
                raise ValueError(f"{name} storage must be one of {', '.join(FORMATS)}, got {fmt!r}")
            if fmt != "bf16" and group not in GROUPS:
                raise ValueError(f"{name} {fmt} scale group must be one of {GROUPS}, got {group!r}")
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


def matrix_bytes(fmt: str, rows: int, k: int, group: int, itemsize: int = 2) -> int:
    """Bytes of ``rows`` x ``k`` weights stored in ``fmt`` (bf16: ``itemsize`` per weight, the model dtype)."""
    if fmt == "bf16":
        return rows * k * itemsize
    kp = padded(k, group)
    return rows * (kp // (2 if fmt == "int4" else 1) + kp // group * 4)


def expert_bytes(storage: Storage, hidden: int, intermediate: int, itemsize: int = 2) -> int:
    """Bytes one resident expert takes on the GPU: gate and up [I, H], down [H, I]."""
    return (matrix_bytes(storage.gate_up, 2 * intermediate, hidden, storage.group, itemsize)
            + matrix_bytes(storage.down, hidden, intermediate, storage.down_group, itemsize))


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """int codes in [-8, 7], [R, Kp] -> uint8 [R, Kp / 2] (the layout above)."""
    R, kp = q.shape
    u = (q.to(torch.int16) + 8).view(R, kp // group, 2, group // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).to(torch.uint8).view(R, kp // 2)


def unpack_int4(packed: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [R, Kp / 2] -> int8 codes [R, Kp]."""
    R, half = packed.shape
    b = packed.to(torch.int16).view(R, half * 2 // group, 1, group // 2)
    return (torch.cat([b & 15, b >> 4], dim=2) - 8).to(torch.int8).view(R, half * 2)


def encode(q: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """int codes [R, Kp] -> the stored codes of ``fmt``."""
    return pack_int4(q, group) if fmt == "int4" else q.to(torch.int8)


def quantize(w: torch.Tensor, fmt: str, group: int) -> tuple:
    """fp32 ``w`` [R, K] -> (codes, fp32 scales [R, Kp / group]), symmetric: scale = max |w| of the group / qmax."""
    R, K = w.shape
    kp = padded(K, group)
    g = F.pad(w.float(), (0, kp - K)).view(R, kp // group, group)
    scale = g.abs().amax(-1) / QMAX[fmt]  # [R, G]
    q = torch.round(g / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-QMAX[fmt], QMAX[fmt])
    return encode(q.view(R, kp), fmt, group), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, group: int, k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored ``codes``/``scales`` of ``fmt`` -> [R, k] in ``dtype`` (scale * q in fp32, then rounded to ``dtype``)."""
    q = unpack_int4(codes, group) if fmt == "int4" else codes
    R, kp = q.shape
    w = q.float().view(R, kp // group, group) * scales.float().unsqueeze(-1)
    return w.view(R, kp)[:, :k].to(dtype)


# ------------------------------------------------------------------------------------ the CPU engine's own codes


def _group(cpu_group: int) -> int:
    """The resident group that holds a CPU group's codes: itself, 128 for per-row int8/int4 (0: the row's scale
    repeated), the default for a group the GPU kernels do not take."""
    return 128 if not cpu_group else cpu_group if cpu_group in GROUPS else DEFAULT_GROUP


def planned_storage(fmt: str, cpu_format: str, cpu_group: int) -> Storage:
    """The storage ``--gpu-experts-format fmt`` gives experts whose CPU format is ``cpu_format`` in ``cpu_group``
    (before any weight exists: the memory plan): auto is the CPU format; int8/int4 of the CPU's format keep its group
    (its codes), another format takes the default group."""
    if fmt == "auto":
        fmt = cpu_format
    if fmt not in FORMATS:
        raise ValueError(f"GPU experts format must be auto or one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "bf16":
        return Storage.of("bf16")
    return Storage.of(fmt, _group(cpu_group) if fmt == cpu_format else DEFAULT_GROUP)


def cpu_storage(cpu_experts) -> Storage:
    """The Storage that holds a CPUExperts' values exactly: its formats and groups (per-row int8/int4: a group of 128,
    the row's scale repeated; a group the GPU kernels do not take: the default)."""
    info = cpu_experts.info()
    if "bf16" in (info["weight_format"], info["down_weight_format"]):
        return Storage.of("bf16")
    return Storage(info["weight_format"], info["down_weight_format"], _group(info["group_size"] or 0),
                   _group(info["down_group_size"] or 0))


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
    return Storage(fmt, fmt, _group(info["group_size"] or 0) if info["weight_format"] == fmt else DEFAULT_GROUP,
                   _group(info["down_group_size"] or 0) if info["down_weight_format"] == fmt else DEFAULT_GROUP)


def cpu_codes(cpu_experts, expert: int, storage: Storage, ranges: Optional[list] = None,
              device=None) -> Optional[tuple]:
    """((gate_up codes, scales), (down codes, scales)) of ``expert`` in ``storage``'s layout, read from the CPU
    engine's packed bytes (``ranges``: hetmoe.moe.streamed.packed.expert_ranges, or read here) and converted on
    ``device`` (default: the CPU; a GPU does it in well under a millisecond, the CPU in a few hundred); an entry is None
    where the engine's matrix is not exactly that (another format or group, affine scaling, bf16, a NUMA-split
    layer)."""
    from hetmoe.moe.streamed import packed

    info = cpu_experts.info()
    if info.get("numa_subpools", 1) != 1:
        return None, None
    layout = packed.ExpertLayout.of(cpu_experts)
    ranges = packed.expert_ranges(cpu_experts) if ranges is None else ranges
    if layout.fmt == "bf16":
        return None, None
    sizes = layout.range_bytes()
    parts = [r[expert * s:(expert + 1) * s].to(device or "cpu") for r, s in zip(ranges, sizes)]
    I, H = layout.intermediate, layout.hidden
    out = []
    for shape, data, scales, fmt, group, n_mats, n in ((layout.gate_up, parts[0], parts[1], storage.gate_up,
                                                        storage.group, 2, I),
                                                       (layout.down, parts[2], parts[3], storage.down,
                                                        storage.down_group, 1, H)):
        if shape.affine or shape.fmt != fmt or shape.group != group:
            out.append(None)
            continue
        nb, G = shape.n_blocks, shape.kp // shape.group
        offset = 128 if fmt == "int8" else 8
        # gate and up row blocks alternate (block 2 rb + m is matrix m's rb): [n_mats, NB * 16, Kp] in row order
        codes = packed._unpack_data(data, shape, n_mats).view(nb, n_mats, packed.ROWS, shape.kp)
        codes = codes.transpose(0, 1).reshape(n_mats * nb * packed.ROWS, shape.kp)
        s = scales.view(torch.float32).view(nb, n_mats, G, packed.ROWS).permute(1, 0, 3, 2)
        s = s.reshape(n_mats, nb * packed.ROWS, G)[:, :n].reshape(n_mats * n, G)
        codes = codes.view(n_mats, nb * packed.ROWS, shape.kp)[:, :n].reshape(n_mats * n, shape.kp) - offset
        out.append((encode(codes, fmt, group), s.clone()))
    return tuple(out)
