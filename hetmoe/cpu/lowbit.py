"""hetmoe's own 3- and 2-bit expert formats, quantized here from float weights (bf16 / fp8 / fp32 checkpoints) and
packed through the exact-codes path (hetmoe/cpu/codes.py ``load_codes``): the engine multiplies by the very values
``dequantize`` gives.

- ``int3`` (3.3125 bits per weight with its scales): 3-bit codes in [-4, 3], symmetric, group 32, k8 scales (an
  int8 sub-scale per group times an fp16 scale per 256 values of a row).
- ``int2`` (2.625 bits per weight, the size of llama.cpp's Q2_K): 2-bit codes in 0..3, affine (value = scale * q -
  min), group 32, k8 scales and mins.

Each group's scale (and min) comes from a search: a grid of candidate scales (int3: the group's largest magnitude mapped
to each end of the code range at a few stretches; int2: the group's range over a few code spans, codes counted from its
minimum), each followed by a least-squares refit of scale (and min) to the codes it rounds to, the candidate of least
squared error kept (optionally weighted by a per-input-column importance, e.g. the mean squared activation of
calibration tokens); then the scales (and mins) are rounded to k8 and the codes rounded again against the stored values.
The search runs in C++ (csrc/formats/lowbit.cpp, threads over rows) with the very arithmetic of the torch reference here
(``reference=True``), sums over a group included (``_gsum``'s fixed pairwise order rather than torch's, which depends on
the CPU): both give the same bits (tests/cpu/test_lowbit.py). Round-to-nearest with a max-abs scale, for comparison, is
``rtn``. Group 16 costs 0.25 (int3) / 0.5 (int2) bits per weight more for 10-15 % less weight error
(tests/cpu/test_lowbit.py measures both), which the chooser of hetmoe/plan/ spends better on a wider format elsewhere.

Gate/up and down may be in different formats (``layout``: a pair), int4 among them: in such a layer int4 is affine,
group 32, k8 scales and mins (4.625 bits per weight, Q4_K's layout; weight error 0.071 against the uniform int4
layers' 0.090 at group 64, and any K that is a multiple of 32): hetmoe/plan/lowbit.py chooses per layer and
projection.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from hetmoe import _C
from hetmoe.cpu.layout import SUPER_BLOCK

# plan name -> (engine format, bits per code, group, scaling, scale dtype)
OWN = {"int3": ("int3", 3, 32, "symmetric", "k8"), "int2": ("int2", 2, 32, "affine", "k8"),
       "int4": ("int4", 4, 32, "affine", "k8")}
VERSION = 2  # of the search (2: group sums in _gsum's order): the expert cache keys layers quantized here on it
BITS_PER_WEIGHT = {"int4": 4.625, "int3": 3.3125, "int2": 2.625}  # with the scales (and mins)
ROWS_AT_ONCE = 256  # rows quantized together: bounds the search's scratch (~ rows x K x 4 bytes x 6)
ROWS_AT_ONCE_CPP = 4096  # the C++ search: rows converted to fp32 at once


def _gsum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) in a fixed order, the first half plus the second down to one value:
    torch's own reduction order depends on the CPU's vector width, this one is what the C++ search does too."""
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t[..., 0]


def _candidates(bits: int, affine: bool) -> tuple:
    """(denominators, how many of the first take the negated value): the candidate scales of a group are its range
    (affine) or its signed value of largest magnitude m (symmetric; -m for the first n) over each denominator."""
    if affine:
        return [(1 << bits) - 1 + t for t in torch.linspace(-0.5, 1.0, 16).tolist()], 0
    stretches = torch.linspace(0.0, 1.5, 7).tolist()
    return [(1 << (bits - 1)) + t for t in stretches] + [(1 << (bits - 1)) - 1 + t for t in stretches], 7


def layout(gate_up: str, down: str) -> dict:
    """CPUExperts keyword arguments of experts whose gate/up are ``gate_up`` and down ``down`` (OWN names)."""
    gu, dn = OWN[gate_up], OWN[down]
    return {"weight_format": gu[0] if gu[0] == dn[0] else (gu[0], dn[0]), "group_size": gu[2],
            "down_group_size": dn[2], "scaling": (gu[3], dn[3]), "scale_dtype": (gu[4], dn[4])}


def _k8(s: torch.Tensor, group: int) -> torch.Tensor:
    """``s`` [R, G] (one per group of a row) rounded to k8: per SUPER_BLOCK values of a row an fp16 d at or above
    max |s| / 127 and int8 sub-scales round(s / d); returns the stored values sub * d (exact in fp32)."""
    per = SUPER_BLOCK // group
    R, G = s.shape
    pad = -G % per
    v = torch.nn.functional.pad(s, (0, pad)).reshape(R, -1, per)
    d = (v.abs().amax(-1, keepdim=True) / 127).half().float()
    d = torch.where(d * 127 < v.abs().amax(-1, keepdim=True), torch.nextafter(d.half(), torch.tensor(
        float("inf"), dtype=torch.half)).float(), d)
    sub = torch.where(d > 0, torch.round(v / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return (sub * d).reshape(R, -1)[:, :G].contiguous()


def _fit(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, affine: bool) -> tuple:
    """Least-squares (scale, offset) of x ~ scale * q + offset over each group (last dim), weighted by w; symmetric:
    offset 0. Groups where the fit is degenerate get scale NaN (the caller keeps its candidate)."""
    wq, wqq, wqx = _gsum(w * q), _gsum(w * q * q), _gsum(w * q * x)
    if not affine:
        return wqx / wqq, torch.zeros_like(wqx)
    sw, swx = _gsum(w.expand_as(x)), _gsum(w * x)
    det = sw * wqq - wq * wq
    s = (sw * wqx - wq * swx) / det
    b = (swx - s * wq) / sw
    bad = det.abs() <= 1e-12 * (sw * wqq).abs()
    return torch.where(bad, float("nan"), s), b


def _search(x: torch.Tensor, w: torch.Tensor, bits: int, affine: bool) -> tuple:
    """x [R, G, g] fp32 -> (scale, offset) [R, G] of least weighted squared error among the candidates."""
    denoms, n_neg = _candidates(bits, affine)
    if affine:
        lo, hi = 0, (1 << bits) - 1
        mn, mx = x.amin(-1), x.amax(-1)
        span = (mx - mn).clamp_min(1e-30)
        cands = [(span / d, mn) for d in denoms]
    else:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        idx = x.abs().argmax(-1, keepdim=True)
        m = x.gather(-1, idx).squeeze(-1)  # the signed value of largest magnitude
        m = torch.where(m == 0, 1e-30, m)
        # m -> the negative end, then m -> the positive end
        cands = [((-m if c < n_neg else m) / d, torch.zeros_like(m)) for c, d in enumerate(denoms)]
    best_s = best_b = best_e = None
    for s0, b0 in cands:
        q = torch.round((x - b0[..., None]) / s0[..., None]).clamp_(lo, hi)
        s, b = _fit(x, w, q, affine)
        keep = torch.isfinite(s) & (s != 0)
        s, b = torch.where(keep, s, s0), torch.where(keep, b, b0)
        # the refit's scale with the candidate's codes, then the codes the refit scale rounds to: error of those
        q = torch.round((x - b[..., None]) / s[..., None]).clamp_(lo, hi)
        e = _gsum(w * (s[..., None] * q + b[..., None] - x) ** 2)
        if best_e is None:
            best_s, best_b, best_e = s, b, e
        else:
            better = e < best_e
            best_s, best_b, best_e = (torch.where(better, s, best_s), torch.where(better, b, best_b),
                                      torch.minimum(e, best_e))
    return best_s, best_b


def quantize(w: torch.Tensor, fmt: str, importance: Optional[torch.Tensor] = None, threads: Optional[int] = None,
             reference: bool = False) -> tuple:
    """``w`` [..., n, k] float -> (codes int8 [..., n, k], scales fp32 [..., n, k / group], mins fp32 or None) of
    OWN format ``fmt``, the values being scales * codes - mins, the scales and mins as their scale dtype stores them.
    ``importance`` [k] (>= 0): per input column, how much its error counts (default: all alike). ``threads``: of the
    C++ search (default: the CPUs this process may use); ``reference``: the torch search instead (the same bits,
    many times slower)."""
    if fmt not in OWN:
        raise ValueError(f"own formats are {', '.join(OWN)}; got {fmt!r}")
    _, bits, g, scaling, sdt = OWN[fmt]
    affine = scaling == "affine"
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    if k % g:
        raise ValueError(f"{fmt}: {k} columns are not a multiple of its group size {g}")
    if importance is not None and (importance.shape != (k,) or not bool((importance >= 0).all())):
        raise ValueError(f"importance must be [{k}] and >= 0")
    rows = w.reshape(-1, k)
    codes = torch.empty(rows.shape, dtype=torch.int8)
    scales = torch.empty(rows.shape[0], k // g)
    mins = torch.empty_like(scales) if affine else None
    imp = (torch.ones(k) if importance is None else importance.float()).reshape(1, k // g, g)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1; got {threads!r}")
    if not reference and hasattr(_C, "lowbit_quantize"):
        imp_c = None if importance is None else importance.float().contiguous()
        denoms, n_neg = _candidates(bits, affine)
        n_threads = threads or len(os.sched_getaffinity(0))
        for r0 in range(0, rows.shape[0], ROWS_AT_ONCE_CPP):
            x = rows[r0:r0 + ROWS_AT_ONCE_CPP].float().contiguous()
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{fmt}: the weights contain NaN or Inf")
            addr = lambda t: 0 if t is None else t[r0:].data_ptr()  # noqa: E731
            _C.lowbit_quantize(x.data_ptr(), x.shape[0], k, g, bits, affine, sdt == "k8",
                               0 if imp_c is None else imp_c.data_ptr(), denoms, n_neg, n_threads, addr(codes),
                               addr(scales), addr(mins))
        shape = lambda t: None if t is None else t.reshape(*lead, n, -1)  # noqa: E731
        return codes.reshape(*lead, n, k), shape(scales), shape(mins)
    lo, hi = (0, (1 << bits) - 1) if affine else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    for r0 in range(0, rows.shape[0], ROWS_AT_ONCE):
        x = rows[r0:r0 + ROWS_AT_ONCE].float().reshape(-1, k // g, g)
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{fmt}: the weights contain NaN or Inf")
        s, b = _search(x, imp, bits, affine)
        if sdt == "k8":
            s, b = _k8(s, g), (-_k8(-b, g) if affine else b)
        q = torch.where(s[..., None] != 0, torch.round((x - b[..., None]) / s[..., None]), 0).clamp_(lo, hi)
        codes[r0:r0 + ROWS_AT_ONCE] = q.reshape(-1, k).to(torch.int8)
        scales[r0:r0 + ROWS_AT_ONCE] = s
        if affine:
            mins[r0:r0 + ROWS_AT_ONCE] = -b
    shape = lambda t: None if t is None else t.reshape(*lead, n, -1)  # noqa: E731
    return codes.reshape(*lead, n, k), shape(scales), shape(mins)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 values of ``quantize``'s output: scale * code - min per group."""
    g = codes.shape[-1] // scales.shape[-1]
    v = codes.float() * scales.repeat_interleave(g, -1)
    return v if mins is None else v - mins.repeat_interleave(g, -1)


def rtn(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round-to-nearest with a max-abs scale (affine: the group's min and max) in ``fmt``'s bits and group, fp32
    scales: the baseline ``quantize`` is measured against. Returns the dequantized values."""
    _, bits, g, scaling, _ = OWN[fmt]
    x = w.float().reshape(*w.shape[:-1], -1, g)
    if scaling == "affine":
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        s = ((mx - mn) / ((1 << bits) - 1)).clamp_min(1e-30)
        return (torch.round((x - mn) / s).clamp(0, (1 << bits) - 1) * s + mn).reshape(w.shape)
    hi = (1 << (bits - 1)) - 1
    s = (x.abs().amax(-1, keepdim=True) / hi).clamp_min(1e-30)
    return (torch.round(x / s).clamp(-hi - 1, hi) * s).reshape(w.shape)


def load_floats(experts, gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                formats: tuple, first_expert: int = 0) -> None:
    """Quantize float experts (per-expert [I, H], [I, H], [H, I] lists, or stacked) into ``experts`` (made with
    ``layout(*formats)``) and pack their codes: gate and up in ``formats[0]``, down in ``formats[1]``."""
    from hetmoe.cpu.codes import load_codes

    mats = [torch.stack(list(m)) if not isinstance(m, torch.Tensor) else m for m in (gate, up, down)]
    out = [quantize(m, f) for m, f in zip(mats, (formats[0], formats[0], formats[1]))]
    load_codes(experts, [o[0] for o in out], [o[1] for o in out], first_expert, mins=[o[2] for o in out],
               scan_first=False)
