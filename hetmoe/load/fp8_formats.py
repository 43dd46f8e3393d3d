"""FP8 weights (E4M3) as Hugging Face checkpoints store them, and how the CPU expert engine holds each at its own bytes.

Three scale layouts, each a ``kind``; config.json's quantization_config says which one a checkpoint has
(``scheme``), and each weight's scale tensor is checked against it before it is used:

- ``block``: DeepSeek-V3's, quant_method "fp8" with weight_block_size [128, 128]: ``<m>.weight_scale_inv`` [ceil(N /
  128), ceil(K / 128)], fp32 (bf16, or E8M0 with scale_fmt "ue8m0": DeepSeek-V4's ``F8_E8M0``). Experts: the engine's
  fp8 group 128 with shared fp32 scales (one per 16 rows and group, FP8_LAYOUTS[128]).
- ``mx``: MXFP8, quant_method "mxfp8" (MiniMax-M3), or "fp8" with weight_block_size [1, 32] and scale_fmt "ue8m0":
  ``<m>.weight_scale_inv`` [N, K / 32] of E8M0 exponent bytes (U8, or F8_E8M0), value = e4m3 x 2^(b - 127). Experts:
  fp8 group 32 with e8m0 scales (FP8_LAYOUTS[32]); the engine's e8m0 byte is 2^(e - 128) (csrc/formats/layout.h, the
  1/2 of E2M1 folded in), so it stores b + 1: every file byte but 255 (E8M0's NaN, refused) fits, at the file's one
  byte per 32 weights.
- ``channel``: one scale per output row, compressed-tensors' ``float-quantized`` with strategy "channel"
  (``<m>.weight_scale`` [N, 1], fp32 / bf16 / fp16), or quant_method "fp8" without weight_block_size whose scales are
  [N, 1]. Experts: fp8 group 128 with fp32 scales per (row, group), the row's scale in each of its groups (4 bytes per
  128 weights, 3% over the file's, ``CHANNEL_LAYOUT``).

Dense weights of every kind are dequantized to the plan's dtype (``dequantize``); only ``block`` ones are kept as FP8
on a GPU (hetmoe/load/dense.py). Whatever the kind, the kernels multiply by exactly e4m3(code) x scale.
"""

from __future__ import annotations

from typing import Optional

import torch

from hetmoe.cpu.layout import FP8_LAYOUTS

BLOCK = 128  # block: one scale per 128 x 128
MX_BLOCK = 32  # mx: one E8M0 scale per 32 values of a row
E8M0_NAN = 255
KINDS = ("block", "mx", "channel")
SCALE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
CHANNEL_LAYOUT = {"scale_dtype": "fp32", "shared_scales": False}  # fp8 group 128, the row's scale in every group
GROUPS = {"block": BLOCK, "mx": MX_BLOCK, "channel": BLOCK}  # the engine's fp8 group of each kind
NAMES = {"block": "block FP8 (an fp32 scale per 128x128 block)", "mx": "MXFP8 (an E8M0 scale per 32 weights)",
         "channel": "per-channel FP8 (an fp32 scale per row)"}


def scheme(qc) -> Optional[str]:
    """The kind of FP8 weights quantization_config ``qc`` describes (None: no FP8 weights, or a setting ``check``
    refuses)."""
    if not isinstance(qc, dict):
        return None
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    block = list(block) if isinstance(block, (list, tuple)) else block
    if method == "mxfp8":
        return "mx" if block in (None, [1, MX_BLOCK]) else None
    if method == "fp8":
        if block == [BLOCK, BLOCK]:
            return "block"
        if block == [1, MX_BLOCK] and qc.get("scale_fmt") == "ue8m0":
            return "mx"
        return "channel" if block is None else None
    if method == "compressed-tensors" and qc.get("format") == "float-quantized":
        return "channel"
    return None


def check(qc, source) -> str:
    """The kind of an "fp8" / "mxfp8" quantization_config ``qc``, or ValueError naming the setting hetmoe does not
    read (``source``: the config file, for the message)."""
    method = qc.get("quant_method")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: quantization_config fmt is {fmt!r}; hetmoe reads FP8 weights in e4m3")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{source}: quantization_config activation_scheme is {qc['activation_scheme']!r}; hetmoe "
                         "reads checkpoints without activation scales (dynamic)")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise ValueError(f"{source}: quantization_config scale_fmt is {scale_fmt!r}; scales are read as 'float' or "
                         "'ue8m0'")
    kind = scheme(qc)
    if kind is None:
        raise ValueError(f"{source}: quantization_config {method} with weight_block_size "
                         f"{qc.get('weight_block_size')!r} and scale_fmt {scale_fmt!r}: hetmoe reads FP8 in blocks of "
                         f"[{BLOCK}, {BLOCK}] (DeepSeek), [1, {MX_BLOCK}] with ue8m0 scales (MXFP8) or one scale per "
                         "row (no weight_block_size)")
    return kind


def scale_suffixes(kind: str) -> tuple:
    """How a weight's scale is named after the weight's own name (``<m>.weight`` + suffix), by kind: the first found
    is read (compressed-tensors' per-channel ``weight_scale``; the others' ``weight_scale_inv``)."""
    return ("_scale", "_scale_inv") if kind == "channel" else ("_scale_inv",)


def check_scale(kind: str, shape: tuple, scale_shape: tuple, scale_dtype: torch.dtype, name: str,
                scale_name: Optional[str] = None) -> None:
    """ValueError unless a ``kind`` scale ``scale_name`` of ``scale_shape`` / ``scale_dtype`` goes with the weight
    ``name`` of ``shape`` [N, K]."""
    N, K = shape
    if kind == "block":
        want, dtypes = (-(-N // BLOCK), -(-K // BLOCK)), SCALE_FLOATS + (torch.float8_e8m0fnu,)
    elif kind == "mx":
        want, dtypes = (N, K // MX_BLOCK), E8M0_DTYPES
        if K % MX_BLOCK:
            raise ValueError(f"{name} is [{N}, {K}]: MXFP8 weights need K a multiple of {MX_BLOCK}")
    else:
        want, dtypes = (N, 1), SCALE_FLOATS
        scale_shape = tuple(scale_shape) + ((1,) if len(scale_shape) == 1 else ())
    what = scale_name or f"{name}'s scale"
    if tuple(scale_shape) != want:
        raise ValueError(f"{what} has shape {tuple(scale_shape)}; {NAMES[kind]} of a [{N}, {K}] weight needs "
                         f"{list(want)}")
    if scale_dtype not in dtypes:
        raise ValueError(f"{what} has dtype {str(scale_dtype).replace('torch.', '')}; {NAMES[kind]} scales are "
                         + ", ".join(str(d).replace("torch.", "") for d in dtypes))


def e8m0_values(scale: torch.Tensor, name: str) -> torch.Tensor:
    """E8M0 exponent bytes (uint8 or float8_e8m0fnu) -> fp32 2^(b - 127), exact; ValueError for the byte 255 (NaN)."""
    b = scale.contiguous().view(torch.uint8)
    if b.numel() and int(b.max()) == E8M0_NAN:
        at = [int(i) for i in (b == E8M0_NAN).nonzero()[0]]
        raise ValueError(f"{name} has the E8M0 scale byte 255 (NaN: not a scale) at {at}")
    bits = torch.where(b < 2, torch.tensor(0x00400000, dtype=torch.int32) << b.to(torch.int32),
                       b.to(torch.int32) << 23)
    return bits.view(torch.float32)


def row_scales(kind: str, scale: torch.Tensor, rows: int, cols: int, name: str) -> torch.Tensor:
    """A ``kind`` scale as fp32 [rows, ceil(cols / GROUPS[kind])]: one per (row, group of the engine's fp8 group),
    what hetmoe.cpu.codes.load_fp8 takes."""
    if kind == "block":
        return scale.float().repeat_interleave(BLOCK, 0)[:rows]
    if kind == "mx":
        return e8m0_values(scale, name)
    return scale.float().reshape(rows, 1).expand(rows, -(-cols // BLOCK))


def dequantize(kind: str, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "FP8 weight") -> torch.Tensor:
    """e4m3 ``w`` [N, K] times its ``kind`` scale, computed in fp32 (exact: a 4-bit significand times a power of two or
    an fp32 scale rounds once), in ``dtype``. ValueError for a scale that does not go with ``w``."""
    if w.dim() != 2:
        raise ValueError(f"FP8 tensor {name} must be 2-D, got shape {tuple(w.shape)}")
    N, K = w.shape
    check_scale(kind, tuple(w.shape), tuple(scale.shape), scale.dtype, name)
    s = row_scales(kind, scale, N, K, name)
    group = K if kind == "channel" else GROUPS[kind]
    s = s[:, :1].expand(N, K) if kind == "channel" else s.repeat_interleave(group, 1)[:, :K]
    return (w.float() * s).to(dtype)


def layout(kind: str) -> dict:
    """The CPUExperts keyword arguments holding ``kind`` experts at their own bytes."""
    group = GROUPS[kind]
    extra = CHANNEL_LAYOUT if kind == "channel" else FP8_LAYOUTS[group]
    return {"weight_format": "fp8", "group_size": group, "down_group_size": group,
            "scaling": ("symmetric", "symmetric"), "scale_dtype": (extra["scale_dtype"],) * 2,
            "shared_scales": (extra["shared_scales"],) * 2}
