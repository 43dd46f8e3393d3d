"""GGUF's ternary blocks (TQ2_0, TQ1_0) as the codes the expert engine's int2 format holds exactly
(hetmoe/cpu/codes.py EXACT_TYPES: int2 symmetric, group 128, fp16 scales; csrc/formats/layout.h). Byte layouts
(llama.cpp's ggml-common.h; gguf.quants reads the same), super-blocks of 256 values, value = d * (q - 1):

- TQ2_0, 66 bytes: 64 bytes of 2-bit q, fp16 d. Value 128 c + 32 s + j is bits 2 s of byte 32 c + j (c in 0..1,
  s in 0..3, j in 0..31). q in 0..2 as llama.cpp writes it; 3 (value 2 d) is a valid block too.
- TQ1_0, 54 bytes: 48 bytes of five trits each, 4 bytes of four trits each, fp16 d. Trit n of byte b is
  ((b * 3^n mod 256) * 3) >> 8 (bytes hold the trits as a fixed-point fraction of 3^5); bytes 0..31 give values
  32 n + j, bytes 32..47 values 160 + 16 n + j, bytes 48..51 values 240 + 4 n + j.

-> codes q - 1 in {-1, 0, 1}, and d as the scale of both groups of 128 (fp32(d) is an fp16 value: held as fp16).
So the engine holds 2 bits + 16 / 128 = 2.125 bits per weight: 1.03x TQ2_0's 2.0625, 1.26x TQ1_0's 1.6875. A group
holding a TQ2_0 q of 3 (code 2, past int2's [-2, 1]) is held negated, codes 1 - q with scale -d: the same values
(its zeros as -0.0).

Decoded in numpy, vectorized over the blocks (shifts for TQ2_0, uint8 products and compares for TQ1_0), a cache's
worth of super-blocks a pass, on the experts' threads.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

QK = 256  # values per super-block
GROUP = 128  # values per engine scale group: each super-block's d twice
TERNARY = {"TQ2_0": 66, "TQ1_0": 54}  # GGML type -> bytes per super-block
# TQ1_0's (first byte, bytes, trits per byte) parts: values [first value, + trits * bytes)
_TQ1_PARTS = ((0, 32, 5), (32, 16, 5), (48, 4, 4))


def ternary_codes(raw: np.ndarray, kind: str, shape: tuple, threads: int = 1) -> tuple:
    """(codes int8 ``shape`` in [-1, 1] (a TQ2_0 group with a q of 3: [-2, 1]), scales fp32 ``shape[:-1] +
    (shape[-1] / 128,)``) of the ``kind`` matrix ``raw`` (its bytes: rows of super-blocks); ValueError for rows that
    are not whole super-blocks or a byte count that does not match the shape. ``threads``: rows decoded on that many
    threads at once (numpy releases the GIL)."""
    nbytes = TERNARY[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if cols % QK:
        raise ValueError(f"{kind} rows of {cols} values are not whole blocks of {QK}")
    raw = np.ascontiguousarray(np.asarray(raw, np.uint8)).reshape(-1)
    nb = cols // QK
    if raw.size != rows * nb * nbytes:
        raise ValueError(f"{kind} {list(shape)} needs {rows * nb * nbytes} bytes, got {raw.size}")
    blocks = raw.reshape(rows * nb, nbytes)
    d = np.ascontiguousarray(blocks[:, nbytes - 2:]).view(np.float16)[:, 0].astype(np.float32)
    scales = np.repeat(d, QK // GROUP)  # [rows * nb * 2]: each super-block's d for both its groups
    codes = np.empty((rows * nb, QK), np.int8)
    decode = _tq2_0 if kind == "TQ2_0" else _tq1_0
    cuts = list(range(0, rows * nb, _CHUNK)) + [rows * nb]  # super-blocks a pass over fits in the caches
    if threads <= 1 or len(cuts) < 3:
        for b0, b1 in zip(cuts[:-1], cuts[1:]):
            decode(blocks[b0:b1], codes[b0:b1], scales[2 * b0:2 * b1])
    else:
        list(_executor(threads).map(lambda b0, b1: decode(blocks[b0:b1], codes[b0:b1], scales[2 * b0:2 * b1]),
                                    cuts[:-1], cuts[1:]))
    return torch.from_numpy(codes.reshape(shape)), torch.from_numpy(scales.reshape(*shape[:-1], cols // GROUP))


_CHUNK = 1024  # super-blocks decoded in one pass (256 KiB of codes)
_SHIFTS = np.array([0, 2, 4, 6], np.uint8)[:, None]
_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)[:, None]


def _tq2_0(blocks: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """TQ2_0 super-blocks [n, 66] -> codes [n, 256] and (a group holding a 3: negated) scales [n * 2]."""
    n = blocks.shape[0]
    q = codes.view(np.uint8)
    np.right_shift(blocks[:, :64].reshape(n, 2, 1, 32), _SHIFTS, out=q.reshape(n, 2, 4, 32))
    np.bitwise_and(q, 3, out=q)
    over = q.max() == 3  # (llama.cpp never writes a 3: one pass to know)
    q -= 1  # uint8: 0 -> 255, the int8 code -1
    if over:
        groups = codes.reshape(n * 2, GROUP)
        flip = (groups == 2).any(axis=-1)
        groups[flip] *= -1
        scales[flip] *= -1


def _tq1_0(blocks: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """TQ1_0 super-blocks [n, 54] -> codes [n, 256]. With x = b * 3^t mod 256 (uint8 products), trit t of byte b,
    (x * 3) >> 8, is 0 below 86 and 2 from 171 on, so the code is (x >= 86) - (x < 171)."""
    n = blocks.shape[0]
    x = np.empty((n, QK), np.uint8)
    for first, n_bytes, trits in _TQ1_PARTS:  # x in the values' order: [n, trits, bytes] per part
        at = 5 * first  # the part's first value: 5 trits per byte before it
        np.multiply(blocks[:, None, first:first + n_bytes], _POW3[:trits],
                    out=x[:, at:at + trits * n_bytes].reshape(n, trits, n_bytes))
    ge, lt = np.greater_equal(x, 86), np.less(x, 171)
    np.subtract(ge.view(np.int8), lt.view(np.int8), out=codes)


@functools.lru_cache(maxsize=None)
def _executor(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="hetmoe-ternary")
