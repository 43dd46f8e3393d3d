"""GGUF's 4-bit codebook blocks (IQ4_NL, IQ4_XS, MXFP4, NVFP4) as the codes and scales the expert engine's lut4 format
holds exactly (hetmoe/cpu/codes.py; csrc/formats/layout.h). Byte layouts (llama.cpp's ggml-common.h; gguf.quants reads
the same):

- IQ4_NL, 18 bytes per 32 values: fp16 d, 16 bytes of nibbles (the low nibbles are values 0..15, the high ones
  16..31); value = d * kvalues_iq4nl[q]. -> indices q, scale fp32(d) (an fp16 value: held as fp16).
- IQ4_XS, 136 bytes per super-block of 256: fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of nibbles (8
  sub-blocks of 32, each as IQ4_NL's 16 bytes). Sub-block j's 6-bit scale ls = (scales_l[j / 2] >> 4 (j % 2)) & 15 |
  ((scales_h >> 2 j) & 3) << 4, value = (d * (ls - 32)) * kvalues_iq4nl[q]. -> indices, scales fp32(d) * (ls - 32):
  one fp32 rounding that is exact (11 + 6 significant bits), as gguf's numpy dequantization computes it; the engine
  holds them as k8 (csrc/formats/layout.h: the int8 ls - 32 and the fp16 d again).
- MXFP4, 17 bytes per 32 values: an E8M0 exponent byte e, 16 bytes of nibbles (IQ4_NL's order); value =
  kvalues_mxfp4[q] * 2^(e - 128) (the E2M1 values doubled to integers, the 1/2 in the scale: ggml's
  GGML_E8M0_TO_FP32_HALF). -> indices, scale 2^(e - 128) as fp32 (e8m0 holds it as the byte e).
- NVFP4, 36 bytes per 64 values: four UE4M3 scale bytes (one per 16 values: 4 exponent bits of bias 7, 3 mantissa
  bits; 0 and 0x7F mean 0), then four sub-blocks of 8 bytes of nibbles (the low nibbles are the sub-block's values
  0..7, the high ones 8..15); value = kvalues_mxfp4[q] * ue4m3(s) / 2. -> indices, scale ue4m3(s) / 2 per group of
  16: at most 4 significant bits in 2^-10 .. 224 (the engine keeps the byte: e4m3 scales of factor 1, the file's
  bytes).

The indices go through the codebook in the kernels, so codebook value x scale is bitwise gguf's dequantization. Decoded
in numpy, vectorized over the blocks (the nibble split is the same work as Q4_0's: hetmoe/load/gguf/checkpoint.py).
"""

from __future__ import annotations

import numpy as np
import torch

# GGML type -> (values per block, bytes per block)
LUT4_BLOCKS = {"IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17), "NVFP4": (64, 36)}
LUT4_GROUP = {"NVFP4": 16}  # values per scale where it is not 32


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] -> uint8 [..., 32]: the low nibbles (values 0..15), then the high ones (16..31)."""
    out = np.empty((*qs.shape[:-1], 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[..., :16])
    np.right_shift(qs, 4, out=out[..., 16:])
    return out


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> fp32 2^(e - 128) (e < 2: the subnormals 2^-128, 2^-127), ggml's E8M0_TO_FP32_HALF."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def ue4m3_half(s: np.ndarray) -> np.ndarray:
    """UE4M3 scale bytes -> fp32 ue4m3(s) / 2 as ggml (and gguf's NVFP4) decode them: exponent bits 3..6 of bias 7,
    mantissa bits 0..2 (exponent 0: subnormal, m * 2^-9), the bytes 0 and 0x7F zero; bit 7 is not read."""
    e = ((s >> 3) & 15).astype(np.int32)
    m = (s & 7).astype(np.float32)
    value = np.where(e == 0, m * np.float32(2.0**-9), (1 + m / 8) * np.exp2(e - 7).astype(np.float32))
    return np.where((s == 0) | (s == 0x7F), np.float32(0), value * np.float32(0.5)).astype(np.float32)


def lut4_codes(raw: np.ndarray, kind: str, shape: tuple) -> tuple:
    """(indices int8 ``shape`` in 0..15, scales fp32 ``shape[:-1] + (shape[-1] / group,)``, group 32, NVFP4's 16)
    of the ``kind`` matrix
    ``raw`` (its bytes: rows of blocks); ValueError for rows that are not whole blocks or a byte count that does not
    match the shape."""
    per, nbytes = LUT4_BLOCKS[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if cols % per:
        raise ValueError(f"{kind} rows of {cols} values are not whole blocks of {per}")
    raw = np.ascontiguousarray(np.asarray(raw, np.uint8)).reshape(-1)
    if raw.size != rows * cols // per * nbytes:
        raise ValueError(f"{kind} {list(shape)} needs {rows * cols // per * nbytes} bytes, got {raw.size}")
    blocks = raw.reshape(rows, cols // per, nbytes)
    if kind == "IQ4_XS":
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
        high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)[..., 0].astype(np.int32)
        low = blocks[..., 4:8].astype(np.int32)
        j = np.arange(8)
        ls = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high[..., None] >> (2 * j)) & 3) << 4)  # [rows, nb, 8]
        scales = d[..., None] * (ls - 32).astype(np.float32)
        q = _nibbles(blocks[..., 8:].reshape(rows, cols // per, 8, 16))
    elif kind == "MXFP4":
        scales = e8m0_half(blocks[..., 0])
        q = _nibbles(blocks[..., 1:])
    elif kind == "NVFP4":
        scales = ue4m3_half(blocks[..., 0:4])  # [rows, nb, 4]
        qs = blocks[..., 4:].reshape(rows, cols // per, 4, 8)
        q = np.empty((rows, cols // per, 4, 16), np.uint8)
        np.bitwise_and(qs, 0x0F, out=q[..., :8])
        np.right_shift(qs, 4, out=q[..., 8:])
    else:  # IQ4_NL
        scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        q = _nibbles(blocks[..., 2:])
    codes = torch.from_numpy(q.reshape(shape).view(np.int8))
    group = LUT4_GROUP.get(kind, 32)
    return codes, torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(*shape[:-1], cols // group))
