"""GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) as codes the expert engine holds exactly (hetmoe/cpu/codes.py).

A K-quant row is cut in super-blocks of 256 values. Byte layouts (llama.cpp's ggml-common.h; gguf.quants reads the
same):

- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles. Sub-block
  j (32 values) is value = (d * sc_j) * q - (dmin * m_j), q in 0..15: the low nibbles of bytes 32c..32c+31 are
  sub-block 2c, the high nibbles sub-block 2c+1. -> int4 affine, group 32.
- Q5_K, 176 bytes: as Q4_K with 32 bytes of high bits after the scales: bit j of byte i is bit 4 of value i of
  sub-block j, q in 0..31. -> int8 affine, group 32 (8 bits hold 5 exactly).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d; value =
  (d * sc_g) * (q - 32) for groups g of 16, q in 0..63. -> int8 symmetric, group 16.

The scales (and mins) are computed in fp32 exactly as gguf's numpy dequantization computes them (fp16 -> fp32,
times the small integer as fp32), so scale * code (- min) is bitwise what ``gguf.quants.dequantize`` gives.
"""

from __future__ import annotations

import numpy as np
import torch

QK = 256  # values per super-block
# GGML type -> (engine format, scaling, group, bytes per super-block)
KQUANTS = {"Q4_K": ("int4", "affine", 32, 144), "Q5_K": ("int8", "affine", 32, 176),
           "Q6_K": ("int8", "symmetric", 16, 210)}


def _f16(b: np.ndarray) -> np.ndarray:
    """fp16 stored in the last axis' 2 bytes -> fp32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _scale_min(s: np.ndarray) -> tuple:
    """The eight 6-bit scales and mins of Q4_K / Q5_K from their 12 bytes [..., 12] -> uint8 [..., 8] each.
    Pairs 0..3: low 6 bits of bytes 0..3 (scales) and 4..7 (mins); pairs 4..7: the nibbles of bytes 8..11 (low:
    scale, high: min) with bits 4..5 from the top 2 bits of bytes 0..3 (scales) and 4..7 (mins)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K nibbles [..., 128] -> values [..., 8, 32] of the 8 sub-blocks (low nibbles of chunk c are
    sub-block 2c, high ones 2c + 1)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((chunks >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def kquant_codes(raw: np.ndarray, kind: str, shape: tuple) -> tuple:
    """(codes int8 ``shape``, scales fp32 ``shape[:-1] + (cols / group,)``, mins of the same shape or None) of the
    K-quant matrix ``raw`` (its bytes: rows of super-blocks) of type ``kind``; ValueError for a shape that is not
    whole super-blocks or a byte count that does not match."""
    fmt, scaling, group, nbytes = KQUANTS[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if cols % QK:
        raise ValueError(f"{kind} rows of {cols} values are not whole super-blocks of {QK}")
    nb = cols // QK
    raw = np.asarray(raw, np.uint8).reshape(-1)
    if raw.size != rows * nb * nbytes:
        raise ValueError(f"{kind} {list(shape)} needs {rows * nb * nbytes} bytes, got {raw.size}")
    blocks = raw.reshape(rows, nb, nbytes)
    if kind == "Q6_K":
        ql, qh, sc, d = blocks[..., :128], blocks[..., 128:192], blocks[..., 192:208], _f16(blocks[..., 208:210])
        low = ((ql.reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F)
        high = ((qh.reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03)
        q = (low.reshape(rows, nb, 8, 32) | (high.reshape(rows, nb, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        scales = d[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)  # [rows, nb, 16]
        mins = None
    else:
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _scale_min(blocks[..., 4:16])
        if kind == "Q4_K":
            q = _low_high(blocks[..., 16:144])
        else:
            qh = blocks[..., 16:48].reshape(rows, nb, 1, 32)
            bits = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 0x01  # [rows, nb, 8, 32]
            q = _low_high(blocks[..., 48:176]) | (bits << 4)
        q = q.astype(np.int8)
        scales = d[..., None] * sc.astype(np.float32)
        mins = dmin[..., None] * mn.astype(np.float32)
    out_groups = shape[:-1] + (cols // group,)
    codes = torch.from_numpy(np.ascontiguousarray(q).reshape(shape))
    scales = torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(out_groups))
    mins = None if mins is None else torch.from_numpy(np.ascontiguousarray(mins, np.float32).reshape(out_groups))
    return codes, scales, mins
