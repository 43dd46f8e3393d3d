"""GGUF's K-quant blocks (Q2_K .. Q6_K) as codes the expert engine holds exactly (hetmoe/cpu/codes.py).

A K-quant row is cut in super-blocks of 256 values. Byte layouts (llama.cpp's ggml-common.h; gguf.quants reads the
same):

- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles. Sub-block
  j (32 values) is value = (d * sc_j) * q - (dmin * m_j), q in 0..15: the low nibbles of bytes 32c..32c+31 are
  sub-block 2c, the high nibbles sub-block 2c+1. -> int4 affine, group 32.
- Q5_K, 176 bytes: as Q4_K with 32 bytes of high bits after the scales: bit j of byte i is bit 4 of value i of
  sub-block j, q in 0..31. -> int5 affine, group 32 (5 bits per code, as the file).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d; value =
  (d * sc_g) * (q - 32) for groups g of 16, q in 0..63. -> int6 symmetric, group 16.
- Q3_K, 110 bytes: 32 bytes of high-bit masks, 64 bytes of 2-bit lows, 12 bytes of sixteen 6-bit scales, fp16 d;
  value = (d * (sc_g - 32)) * q for groups g of 16, q in [-4, 3] (the low 2 bits, minus 4 where the mask bit is
  clear). -> int3 symmetric, group 16.
- Q2_K, 84 bytes: 16 bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit codes, fp16 d, fp16 dmin; value =
  (d * sc_g) * q - (dmin * m_g) for groups g of 16, q in 0..3. -> int2 affine, group 16.

The engine holds the scales (and mins) in its k8 scale dtype: the file's int8 sub-scales and fp16 super scales again
(csrc/formats/layout.h), split back out of the fp32 values given here; Q2_K's in k4 (its 4-bit sub-scale and sub-min
pairs, fp16 d and dmin: 84 bytes per 256 values as in the file; hetmoe/cpu/codes.py EXACT_TYPES).

The scales (and mins) are computed in fp32 exactly as gguf's numpy dequantization computes them (fp16 -> fp32,
times the small integer as fp32), so scale * code (- min) is bitwise what ``gguf.quants.dequantize`` gives. The
decoding itself is C++ (csrc/formats/gguf_blocks.cpp: a numpy version ran at 0.08 GB/s of file).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from hetmoe import _C

QK = 256  # values per super-block
# GGML type -> (engine format, scaling, group, bytes per super-block)
KQUANTS = {"Q4_K": ("int4", "affine", 32, 144), "Q5_K": ("int5", "affine", 32, 176),
           "Q6_K": ("int6", "symmetric", 16, 210), "Q3_K": ("int3", "symmetric", 16, 110),
           "Q2_K": ("int2", "affine", 16, 84)}


def kquant_codes(raw: np.ndarray, kind: str, shape: tuple, out: Optional[tuple] = None, threads: int = 1) -> tuple:
    """(codes int8 ``shape``, scales fp32 ``shape[:-1] + (cols / group,)``, mins of the same shape or None) of the
    K-quant matrix ``raw`` (its bytes: rows of super-blocks) of type ``kind``, decoded in C++
    (csrc/formats/gguf_blocks.cpp); ValueError for a shape that is not whole super-blocks or a byte count that does
    not match. ``out``: the three tensors to decode into (reused buffers; their shapes checked), ``threads``: rows
    decoded on that many threads at once (the decoder releases the GIL)."""
    fmt, scaling, group, nbytes = KQUANTS[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if cols % QK:
        raise ValueError(f"{kind} rows of {cols} values are not whole super-blocks of {QK}")
    raw = np.ascontiguousarray(np.asarray(raw, np.uint8)).reshape(-1)
    row_bytes = cols // QK * nbytes
    if raw.size != rows * row_bytes:
        raise ValueError(f"{kind} {list(shape)} needs {rows * row_bytes} bytes, got {raw.size}")
    want = (tuple(shape), (*shape[:-1], cols // group))
    if out is None:
        codes = torch.empty(shape, dtype=torch.int8)
        scales = torch.empty(*shape[:-1], cols // group)
        mins = torch.empty_like(scales) if scaling == "affine" else None
    else:
        codes, scales, mins = out
        if (tuple(codes.shape), tuple(scales.shape)) != want or (mins is None) != (scaling != "affine") or not all(
                t is None or t.is_contiguous() for t in out):
            raise ValueError(f"{kind} {list(shape)}: the output tensors do not have its shapes")
    per_row = cols // group

    def decode(r0: int, r1: int) -> None:
        at = 4 * r0 * per_row  # bytes into the scales and mins
        _C.decode_kquant(kind, raw.ctypes.data + r0 * row_bytes, r1 - r0, cols, codes.data_ptr() + r0 * cols,
                         scales.data_ptr() + at, 0 if mins is None else mins.data_ptr() + at)

    if threads <= 1 or rows < 2 * threads:
        decode(0, rows)
    else:
        cuts = [rows * i // threads for i in range(threads + 1)]
        list(_executor(threads).map(decode, cuts[:-1], cuts[1:]))
    return codes, scales, mins


@functools.lru_cache(maxsize=None)
def _executor(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="hetmoe-kquant")
