"""Routed experts packed from codes quantized already, with no re-quantization: what a GGUF file's blocks hold
becomes the engine's int8 / int4 codes with their own scales (and mins), so the kernels multiply by the very values
``gguf``'s own dequantization gives. The packing itself is csrc/formats/pack.cpp (pack_row_block_codes).

- Q8_0 / Q4_0 / Q5_0 (one fp16 scale per 32: int8 codes in [-127, 127], 4-bit codes in [-8, 7] once llama.cpp's +8
  offset is taken off, 5-bit codes in [-16, 15]): int8 / int4 / int5 symmetric, group 32, fp16 scales, at the file's
  34 / 18 / 22 bytes per 32 values.
- Q4_1 / Q5_1 (value = d * q + m per 32, fp16 d and m, q in 0..15 / 0..31): int4 / int5 affine, group 32, fp16
  scales and mins (min = -m), at the file's 20 / 24 bytes per 32.
- The K-quants, with their two-level scales held as the file holds them (scale dtype k8: an int8 sub-scale per group,
  an fp16 super scale per 256 values; affine mins the same): Q4_K / Q5_K (value = scale * q - min per 32, q in 0..15 /
  0..31) int4 / int5 affine, group 32; Q6_K (value = scale * q per 16, q in [-32, 31]) int6 symmetric, group 16;
  Q3_K (value = d * (sc - 32) * q per 16, q in [-4, 3]) int3 symmetric, group 16; Q2_K (value = scale * q - min
  per 16, q in 0..3) int2 affine, group 16, with its scales and mins in scale dtype k4 instead (a 4-bit sub-scale
  and a 4-bit sub-min per 16 in one byte, an fp16 d and dmin per 256: the file's 84 bytes per 256 values). int6 /
  int5 / int3 / int2 are the bit-plane formats: b bits per code, so each type is held at its file's bytes
  (csrc/formats/layout.h).
- TQ2_0 / TQ1_0 (ternary: value = d * (q - 1), q in 0..2, an fp16 d per 256): int2 symmetric, group 128 (the
  super-block's d for both of its groups), fp16 scales: 2.125 bits per weight against the file's 2.0625 / 1.6875
  (hetmoe/load/gguf/ternary.py).
- IQ4_NL (fp16 scale per 32, 4-bit indices into llama.cpp's kvalues_iq4nl): lut4, codebook iq4nl, fp16 scales.
- IQ4_XS (super-blocks of 256: fp16 d and a 6-bit scale per 32, value = d * (ls - 32) * kvalues_iq4nl[q]): lut4 iq4nl,
  group 32, k8 scales (d * (ls - 32) split into the int8 sub-scale and the fp16 d again).
- MXFP4 (an E8M0 exponent per 32, 4-bit E2M1 codes): lut4, codebook e2m1 (values doubled), e8m0 scales (the
  exponent byte itself: 2^(e - 128) has the 1/2 in it), the file's 17 bytes per 32 values.
- NVFP4 (a UE4M3 scale per 16, E2M1 codes): lut4 e2m1, group 16, fp16 scales (each UE4M3 value halved, exact in
  fp16): 5 bits per weight against the file's 4.5. With ``E4M3_HELD``: e4m3 scales (the UE4M3 byte itself, factor 1),
  the file's 36 bytes per 64 values (and 4 bytes per 16 rows: the row block's factor).
- The i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (grid indices, signs and sub-scales per 256
  values, an fp16 d): grid, its codebook the type (``GRID_TYPES``), group 32 or 16 (the type's scale's), fp16 scales
  (the d): the file's blocks moved into the row blocks as they are and decoded in the kernels (csrc/formats/grid.h),
  the file's bytes exactly. ``load_codes`` takes them as uint8 blocks, not codes and scales.

Scales and mins go in as fp32 (what gguf's dequantization computes them as); the engine stores them in the layout's
scale dtype exactly or refuses them. Codes of lut4 types are codebook indices (0..15). A layer planned as int8 (other
layers need it) takes int8 codes: int4 codes as they are, lut4 indices looked up into their codebook values
(``lut4_values``), exactly either way.

Gate/up and down may differ in format, group and scaling (``CPUExperts(weight_format=(gate_up, down),
down_group_size=..., scaling=(gate_up, down))``): unsloth's Q4_K_M is int4 affine gate/up beside int8 group-16 down.

FP8 checkpoints' E4M3 experts go into the engine's fp8 format byte for byte (``load_fp8``): block FP8 (an fp32 scale
per 128 x 128 block) as group 128 with shared scales (one per 16 rows, the block's), MXFP8 (an E8M0 scale per 32) as
group 32 with e8m0 scales, per-channel FP8 as group 128 with the row's scale in every group.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hetmoe import _C
from hetmoe.cpu.experts import CPUExperts
from hetmoe.cpu.layout import CODEBOOKS, FACTOR_SCALES, GRIDS, PLANES, ROWS, SUPER_BLOCK, TWO_LEVEL, ZERO_POINTS

# GGML i-quant types the grid format holds natively (the first the most used in unsloth's "UD" mixes)
GRID_TYPES = ("IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")

CODE_RANGE = {("int8", "symmetric"): (-127, 127), ("int4", "symmetric"): (-8, 7),
              ("int8", "affine"): (0, 127), ("int4", "affine"): (0, 15), ("lut4", "symmetric"): (0, 15),
              **{(f, "symmetric"): (-(1 << (PLANES[f][2] - 1)), (1 << (PLANES[f][2] - 1)) - 1) for f in PLANES},
              **{(f, "affine"): (0, (1 << PLANES[f][2]) - 1) for f in PLANES}}
# GGML types held exactly -> (format, scaling, group, scale dtype, codebook)
EXACT_TYPES = {"Q8_0": ("int8", "symmetric", 32, "fp16", None), "Q4_0": ("int4", "symmetric", 32, "fp16", None),
               "Q5_0": ("int5", "symmetric", 32, "fp16", None),
               "Q4_1": ("int4", "affine", 32, "fp16", None), "Q5_1": ("int5", "affine", 32, "fp16", None),
               "Q2_K": ("int2", "affine", 16, "k4", None), "Q3_K": ("int3", "symmetric", 16, "k8", None),
               "Q4_K": ("int4", "affine", 32, "k8", None), "Q5_K": ("int5", "affine", 32, "k8", None),
               "Q6_K": ("int6", "symmetric", 16, "k8", None),
               "IQ4_NL": ("lut4", "symmetric", 32, "fp16", "iq4nl"),
               "IQ4_XS": ("lut4", "symmetric", 32, "k8", "iq4nl"),
               "MXFP4": ("lut4", "symmetric", 32, "e8m0", "e2m1"),
               "NVFP4": ("lut4", "symmetric", 16, "fp16", "e2m1"),
               "TQ2_0": ("int2", "symmetric", 128, "fp16", None), "TQ1_0": ("int2", "symmetric", 128, "fp16", None),
               # the i-quants as their files' blocks (csrc/formats/layout.h grid; the group is the type's scale's)
               **{k: ("grid", "symmetric", GRIDS[k.lower()][0], "fp16", k.lower()) for k in GRID_TYPES}}
# NVFP4 experts (GGUF's, hetmoe/load/nvfp4.py's) held at their file's bytes, e4m3 / e4m3_div scales (the E4M3 bytes
# and the per-tensor factor), rather than widened to fp16 / fp32: the CPU engine reads them on every path
# (tests/cpu/test_e4m3_scales.py) and so does the GPU prefill, through its PyTorch reader (hetmoe/moe/streamed/packed.py
# widen_set) and its Triton unpack (hetmoe/ops/triton/packed.py), bit for bit; off until their cost on AMX and in the
# GPU prefill is measured
E4M3_HELD = False
FOUR_BITS = ("int4", "lut4")
# formats whose codes a plan counts as int8 (the row blocks read int16 activations for them); the others as int4
WIDE = ("int8", "int6", "int5")
NARROW = FOUR_BITS + ("int3", "int2")


def exact_layout(gate_up_type: str, down_type: str, plan: Optional[str] = None) -> Optional[dict]:
    """The CPUExperts keyword arguments (``weight_format`` — one format or a (gate/up, down) pair —,
    ``group_size``, ``down_group_size``, ``scaling``, ``scale_dtype``, ``codebook``) that hold gate/up of GGML type
    ``gate_up_type`` and down of ``down_type`` exactly, or None when one is not held exactly. A layer of 4-bit types
    planned as int8 (``plan``; other layers need int8) takes int8 codes, still exactly (lut4 indices looked up into
    their values), so that it has the bytes the plan counted."""
    if gate_up_type not in EXACT_TYPES or down_type not in EXACT_TYPES:
        return None
    gu, down = EXACT_TYPES[gate_up_type], EXACT_TYPES[down_type]
    fmts, books = (gu[0], down[0]), (gu[4], down[4])
    sdts = tuple("e4m3" if E4M3_HELD and t == "NVFP4" else s
                 for t, s in ((gate_up_type, gu[3]), (down_type, down[3])))
    if plan == "int8" and gu[0] in NARROW and down[0] in NARROW:
        # (Q2_K's k4 values split into k8 exactly: int8 layers keep the scale dtypes every reader of int8 takes)
        fmts, books, sdts = ("int8", "int8"), (None, None), tuple("k8" if s == "k4" else s for s in sdts)
    return {"weight_format": fmts[0] if fmts[0] == fmts[1] else fmts, "group_size": gu[2],
            "down_group_size": down[2], "scaling": (gu[1], down[1]), "scale_dtype": sdts, "codebook": books}


def plan_format(layout: dict) -> tuple:
    """(format, group) a memory plan counts for ``layout`` (exact_layout's): fp8 as fp8, int8 when either matrix is
    int8, else int4 (lut4 is a 4-bit format of the same line bytes, grid reads int8 activations as int4 does: a plan's
    int4 holds those layers in their own layout)."""
    fmt = layout["weight_format"]
    if fmt == "fp8":
        return "fp8", layout["group_size"]
    wide = any(f in WIDE for f in (fmt if isinstance(fmt, tuple) else (fmt,)))
    return ("int8" if wide else "int4"), layout["group_size"]


def layout_of(experts: CPUExperts) -> dict:
    """The code layout of ``experts`` as CPUExperts' keyword arguments (what GGUFCheckpoint.exact_format returns)."""
    info = experts.info()
    fmt, down = info["weight_format"], info["down_weight_format"]
    layout = {"weight_format": fmt if fmt == down else (fmt, down), "group_size": info["group_size"],
              "down_group_size": info["down_group_size"], "scaling": (info["gate_up_scaling"], info["down_scaling"]),
              "scale_dtype": (info["gate_up_scale_dtype"], info["down_scale_dtype"]),
              "codebook": (info["gate_up_codebook"], info["down_codebook"])}
    shared = (info["gate_up_shared_scales"], info["down_shared_scales"])
    return {**layout, "shared_scales": shared} if any(shared) else layout  # (fp8 only)


def lut4_values(codes: torch.Tensor, codebook: str) -> torch.Tensor:
    """lut4 indices (int8 0..15) -> their codebook's int8 values: the same weights as int8 codes."""
    return torch.tensor(CODEBOOKS[codebook], dtype=torch.int8)[codes.long()]


def load_codes(experts: CPUExperts, codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
               first_expert: int = 0, mins: Optional[Sequence[Optional[torch.Tensor]]] = None,
               scan_first: bool = True, factors: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
    """Pack experts ``first_expert ..`` of ``experts`` (grouped int8 or int4) from ``codes`` = (gate, up, down) int8
    [n, I, H] / [n, I, H] / [n, H, I] and ``scales`` = the same matrices' fp32 [n, rows, cols / group] (one per
    group of the matrix's group size consecutive columns of a row); a grid matrix takes its GGUF blocks instead,
    uint8 [n, rows, cols / 256 * block bytes] as the file holds them, and no scales (None). ``mins`` (same shapes
    as the scales) for the matrices the experts hold affine (None for symmetric ones). ``factors``: for the matrices
    held with e4m3 / e4m3_div scales (NVFP4's), each expert's per-tensor factor f, fp32 [n] (None: 1), and each scale
    must be fl(e4m3 * f) / 2 (e4m3_div: fl(e4m3 / f) / 2) of an E4M3 value, as the NVFP4 references compute it;
    unread for other scale dtypes. ValueError, naming the
    matrix, for a shape, dtype, group or range the engine cannot hold exactly; nothing of a refused call is marked
    loaded. ``scan_first=False`` (codes a decoder made, in range by construction): the values are scanned only when
    the engine refuses them (it checks ranges and scales as it packs), to name what was wrong; a refused call may
    then have overwritten the experts' bytes (still not marked loaded)."""
    info = experts.info()
    fmt, group, down_group = info["weight_format"], info["group_size"], info["down_group_size"]
    if fmt not in ("int8", "int4", "lut4", "grid", *PLANES) or group <= 0 or down_group <= 0:
        raise ValueError(f"codes load into grouped int8, int4, lut4, grid or bit-plane (int6, int5, int3, int2) "
                         f"experts; these are {fmt} (group {group})")
    mins = (None, None, None) if mins is None else tuple(mins)
    factors = (None, None, None) if factors is None else tuple(factors)
    if len(codes) != 3 or len(scales) != 3 or len(mins) != 3 or len(factors) != 3:
        raise ValueError("codes, scales, mins and factors must each hold (gate, up, down)")
    I, H = experts.intermediate_size, experts.hidden_size
    n = codes[0].shape[0] if codes[0].dim() == 3 else -1
    if not 0 <= first_expert or n < 0 or first_expert + n > experts.num_experts:
        raise ValueError(f"experts [{first_expert}, {first_expert + n}) do not fit in "
                         f"num_experts={experts.num_experts}")
    # per matrix: (name, format, scaling, scale dtype, group, codes, scales, mins or None, factors or None), on the CPU
    ready = []
    layouts = ((fmt, group, info["gate_up_scaling"], info["gate_up_scale_dtype"], info["gate_up_codebook"]),) * 2 + (
        (info["down_weight_format"], down_group, info["down_scaling"], info["down_scale_dtype"],
         info["down_codebook"]),)
    for name, q, s, m, fac, (rows, cols), (mfmt, g, scaling, sdt, book) in zip(
            ("gate", "up", "down"), codes, scales, mins, factors, ((I, H), (I, H), (H, I)), layouts):
        if mfmt == "grid":  # the file's blocks, [n, rows, blocks of the row] bytes; no scales (the blocks hold them)
            row_bytes = cols // SUPER_BLOCK * GRIDS[book][2]
            if cols % SUPER_BLOCK:
                raise ValueError(f"{name}: {cols} columns are not whole {book} blocks of {SUPER_BLOCK}")
            if q.dtype not in (torch.uint8, torch.int8) or tuple(q.shape) != (n, rows, row_bytes):
                raise ValueError(f"{name} ({book} blocks) must be uint8 [{n}, {rows}, {row_bytes}], got {q.dtype} "
                                 f"{list(q.shape)}")
            ready.append((name, mfmt, scaling, sdt, g, q.detach().to("cpu").contiguous().view(torch.int8), None, None,
                          None))
            continue
        if cols % g:
            raise ValueError(f"{name}: {cols} columns are not a multiple of the group size {g}")
        if q.dtype != torch.int8 or tuple(q.shape) != (n, rows, cols):
            raise ValueError(f"{name} codes must be int8 [{n}, {rows}, {cols}], got {q.dtype} {list(q.shape)}")
        if (m is None) != (scaling == "symmetric"):
            raise ValueError(f"{name} is held {scaling}: " + ("mins are needed" if m is None else "it takes no mins"))
        q = q.detach().to("cpu").contiguous()
        s, m = (None if t is None else t.detach().to("cpu", torch.float32).contiguous() for t in (s, m))
        for what, t in (("scales", s), ("mins", m)):
            if t is not None and tuple(t.shape) != (n, rows, cols // g):
                raise ValueError(f"{name} {what} must be [{n}, {rows}, {cols // g}] (one per {g} columns), "
                                 f"got {list(t.shape)}")
        f = None
        if sdt in FACTOR_SCALES:
            f = torch.ones(n) if fac is None else fac.detach().to("cpu", torch.float32).reshape(-1).contiguous()
            if f.numel() != n:
                raise ValueError(f"{name} factors must be {n} values (one per expert), got {f.numel()}")
            if not (torch.isfinite(f) & (f > 0)).all():
                raise ValueError(f"{name} has factors that are not finite and positive: {f.tolist()[:4]}...")
        ready.append((name, mfmt, scaling, sdt, g, q, s, m, f))
    if scan_first:
        _scan(ready)
    (*_, gq, gs, gm, gf), (*_, uq, us, um, uf), (*_, dq, ds, dm, df) = ready
    addr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    try:
        experts._ex.load_codes(first_expert, n, gq.data_ptr(), addr(gs), uq.data_ptr(), addr(us), dq.data_ptr(),
                               addr(ds), addr(gm), addr(um), addr(dm), addr(gf), addr(uf), addr(df))
    except ValueError:
        if not scan_first:
            _scan(ready)  # names the matrix and what is wrong with it
        raise


def _scan(ready: list) -> None:
    """ValueError naming the first matrix whose codes are out of its range, whose scales or mins are not finite, or
    whose scales (or mins) its scale dtype does not hold exactly."""
    for name, mfmt, scaling, sdt, group, q, s, m, f in ready:
        if mfmt == "grid":
            continue  # blocks: the engine names a bad one (a d that is not a number)
        lo, hi = CODE_RANGE[mfmt, scaling]
        qmin, qmax = (int(v) for v in q.aminmax()) if q.numel() else (lo, hi)  # one pass over the codes
        if qmin < lo or qmax > hi:
            held = mfmt if scaling == "symmetric" else f"{mfmt} {scaling}"
            raise ValueError(f"{name} has codes in [{qmin}, {qmax}]; {held} holds [{lo}, {hi}] exactly")
        for what, t in (("scales", s), ("mins", m)):
            # a NaN or Inf makes the sum one (so does an overflow: then the exact test decides)
            if t is not None and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
                raise ValueError(f"{name} has {what} that are NaN or Inf")
        for what, t in (("scales", s), ("mins", m)):
            if t is None:
                continue
            if sdt in TWO_LEVEL:
                bad = _C.two_level_first_inexact_row(sdt, t.data_ptr(), t.numel() // t.shape[-1], t.shape[-1], group)
                if bad >= 0:
                    subs = "int8 sub-scales" if sdt == "k8" else "4-bit unsigned sub-scales"
                    raise ValueError(f"{name} has {what} that {sdt} does not hold exactly (row {bad}: no {subs} "
                                     f"x one fp16 scale per {SUPER_BLOCK} values give "
                                     f"{t.reshape(-1, t.shape[-1])[bad][:4].tolist()}...)")
                continue
            if what == "mins" and sdt in ZERO_POINTS:
                inexact = ~zero_points_of(s, t)[1]
                if inexact.any():
                    raise ValueError(f"{name} has mins that {sdt} does not hold exactly: no int8 zero point z gives "
                                     f"fl(scale * z) = {float(t[inexact][0])!r}")
                continue
            inexact = ~held_exactly(t, ZERO_POINTS.get(sdt, sdt), f)
            if inexact.any():
                at = " at its factor" if sdt in FACTOR_SCALES else ""
                raise ValueError(f"{name} has {what} that {sdt} does not hold exactly{at} (e.g. "
                                 f"{float(t[inexact][0])!r})")


def zero_points_of(scales: torch.Tensor, mins: torch.Tensor) -> tuple:
    """(z, held): the int8 zero points z of affine ``mins`` against fp32 ``scales`` (the same shape) as the
    zero-point scale dtypes hold them (csrc/formats/layout.h: min = fl(scale * z), z in [-128, 127]), and where some
    z gives the min bit for bit (z nearest min / scale; for the signed zeros of a zero scale, 0 or -1)."""
    s, m = scales.float(), mins.float()
    near = torch.where(s != 0, torch.round(m.double() / s.double()), torch.zeros_like(m, dtype=torch.float64))
    z = torch.zeros_like(m, dtype=torch.int8)
    held = torch.zeros_like(m, dtype=torch.bool)
    for d in (0.0, -1.0, 1.0):
        c = (near + d).nan_to_num(0.0)
        fits = (c >= -128) & (c <= 127)
        cz = c.clamp(-128, 127)
        ok = fits & ~held & ((s * cz.float()).view(torch.int32) == m.view(torch.int32))
        z = torch.where(ok, cz.to(torch.int8), z)
        held |= ok
    return z, held


def e4m3_scales(factor: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """fp32 [.., 256]: the scale each E4M3 byte stands for in e4m3 / e4m3_div matrices of per-tensor factors
    ``factor`` [..]: fl(e4m3 * f) / 2 (fl(e4m3 / f) / 2), as the kernels widen it (csrc/formats/layout.h: the
    half of e4m3 * 2^-8 times f * 2^7, or over f * 2^-7; the NaN codes 0x7F, 0xFF give no scale: NaN)."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 2.0**-8
    f = factor.float().unsqueeze(-1)
    return e4m3 / (f * 2.0**-7) if scale_dtype == "e4m3_div" else e4m3 * (f * 2.0**7)


def held_exactly(s: torch.Tensor, scale_dtype: str, factors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which fp32 scales ``s`` [n, ...] the scale dtype stores exactly (csrc/formats/layout.h; e8m0: 2^(e - 128), e
    in 0..255; e4m3 / e4m3_div: a byte's scale at its matrix's factor, ``factors`` [n] (None: 1); k8 and k4 hold a
    row's values together: ``_scan``)."""
    if scale_dtype in FACTOR_SCALES:
        f = torch.ones(s.shape[0]) if factors is None else factors
        table = e4m3_scales(f, scale_dtype)  # [n, 256]
        flat = s.reshape(s.shape[0], -1).contiguous()
        return torch.stack([torch.isin(flat[i].view(torch.int32), table[i].view(torch.int32))
                            for i in range(flat.shape[0])]).reshape(s.shape)
    if scale_dtype == "fp32":
        return torch.ones_like(s, dtype=torch.bool)
    if scale_dtype in ("fp16", "bf16"):
        narrow = s.to(torch.float16 if scale_dtype == "fp16" else torch.bfloat16).float()
        return narrow.view(torch.int32) == s.view(torch.int32)
    if scale_dtype in TWO_LEVEL:
        raise ValueError(f"{scale_dtype} scales are held a row at a time (codes._scan), not one by one")
    mantissa, exponent = torch.frexp(s)  # e8m0: a power of two 2^(exponent - 1) in [2^-128, 2^127]
    return (mantissa == 0.5) & (exponent >= -127) & (exponent <= 128)


E4M3_NAN = 0x7F  # with or without the sign bit: the only E4M3 codes that are not numbers


def load_fp8(experts: CPUExperts, codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
             first_expert: int = 0) -> None:
    """Pack experts ``first_expert ..`` of fp8 ``experts`` from E4M3 ``codes`` = (gate, up, down) float8_e4m3fn (or
    uint8: the codes' bytes) [n, I, H] / [n, I, H] / [n, H, I] and ``scales`` = the same matrices' fp32
    [n, rows, ceil(cols / group)] (one per group of the matrix's group size consecutive columns of a row; shared
    scales: the same for each 16 rows). The kernels then multiply by exactly e4m3(code) * scale. ValueError, naming
    the matrix, for a shape or dtype the engine does not take, an E4M3 NaN code (0x7F / 0xFF), a scale that is not
    finite or that the scale dtype does not hold exactly, or shared scales that differ within 16 rows; nothing of a
    refused call is marked loaded."""
    info = experts.info()
    fmt, group, down_group = info["weight_format"], info["group_size"], info["down_group_size"]
    if fmt != "fp8" or not group or not down_group:
        raise ValueError(f"E4M3 codes load into grouped fp8 experts; these are {fmt} (group {group})")
    if len(codes) != 3 or len(scales) != 3:
        raise ValueError("codes and scales must each hold (gate, up, down)")
    I, H = experts.intermediate_size, experts.hidden_size
    n = codes[0].shape[0] if codes[0].dim() == 3 else -1
    if not 0 <= first_expert or n < 0 or first_expert + n > experts.num_experts:
        raise ValueError(f"experts [{first_expert}, {first_expert + n}) do not fit in "
                         f"num_experts={experts.num_experts}")
    ready = []
    layouts = ((group, info["gate_up_scale_dtype"], info["gate_up_shared_scales"]),) * 2 + (
        (down_group, info["down_scale_dtype"], info["down_shared_scales"]),)
    for name, q, s, (rows, cols), (g, sdt, shared) in zip(("gate", "up", "down"), codes, scales,
                                                          ((I, H), (I, H), (H, I)), layouts):
        if q.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(q.shape) != (n, rows, cols):
            raise ValueError(f"{name} codes must be float8_e4m3fn (or their uint8 bytes) [{n}, {rows}, {cols}], got "
                             f"{q.dtype} {list(q.shape)}")
        groups = -(-cols // g)
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != (n, rows, groups):
            raise ValueError(f"{name} scales must be [{n}, {rows}, {groups}] (one per {g} columns), got "
                             f"{list(getattr(s, 'shape', ()))}")
        q = q.detach().to("cpu").contiguous().view(torch.uint8)
        s = s.detach().to("cpu", torch.float32).contiguous()
        nan = (q & E4M3_NAN) == E4M3_NAN
        if nan.any():
            e, r, c = (int(i) for i in nan.nonzero()[0])
            raise ValueError(f"{name} of expert {first_expert + e} holds the E4M3 NaN code 0x{int(q[e, r, c]):02X} at "
                             f"[{r}, {c}]; fp8 weights must be numbers")
        if not torch.isfinite(s).all():
            raise ValueError(f"{name} has scales that are NaN or Inf")
        inexact = ~held_exactly(s, sdt)
        if inexact.any():
            raise ValueError(f"{name} has scales that {sdt} does not hold exactly (e.g. {float(s[inexact][0])!r})")
        if shared:
            head = s[:, ::ROWS].repeat_interleave(ROWS, 1)[:, :rows]  # each row block's first row's
            if not torch.equal(s, head):
                raise ValueError(f"{name} has shared scales (one per {ROWS} rows and group) that differ within "
                                 f"{ROWS} rows")
        ready.append((q, s))
    (gq, gs), (uq, us), (dq, ds) = ready
    experts._ex.load_codes(first_expert, n, gq.data_ptr(), gs.data_ptr(), uq.data_ptr(), us.data_ptr(),
                           dq.data_ptr(), ds.data_ptr(), 0, 0, 0)


def block_fp8_scales(scale_inv: torch.Tensor, rows: int, block: int = 128) -> torch.Tensor:
    """A block FP8 weight's ``scale_inv`` [ceil(rows / block), ceil(cols / block)] as load_fp8's per-row scales
    [rows, ceil(cols / block)] (each block's scale in each of its rows; fp32)."""
    return scale_inv.float().repeat_interleave(block, 0)[:rows]
