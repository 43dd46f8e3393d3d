"""The grid format (GGUF's i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M held at their file's bytes,
csrc/formats/layout.h) decoded with PyTorch ops, on any device: what lets the GPU compute a layer of i-quant experts
from the very bytes the CPU engine holds (the layerwise prefill copies them as they are: PCIe moves the file's bytes),
and GPU-resident experts take the engine's own int8 codes and scales (hetmoe/moe/gpu_resident/format.py).

The decoding is csrc/formats/grid.h's, on whole tensors at once: each 8 values of a row (a "chunk") are one int64
word of 8 int8 codes, looked up in the type's grid (entries of 8 values, or two entries of 4: IQ3_*), their signs
applied as llama.cpp's sign masks (byte j 0xFF where value j is negative: (g ^ m) + (m & 0x01..01), no carry between
bytes since every grid value is >= 1), IQ1's 8 g +- 1 looked up whole (a table per sign of the delta). The codes are
integers |q| <= 63 and each group's scale is one exact fp32 product d * (odd sub-scale) * (a power of two), so
scale * q is bitwise what the CPU kernels multiply by and what gguf.quants.dequantize computes. The grids come from
gguf-py's tables (``gguf.quants.IQ*.grid``: the source csrc/formats/grid_tables.h was written from; the package
reads every GGUF file hetmoe loads, so a grid matrix never exists without it).

Work per value: a few passes over int64 words (one per 8 values), then one pass reading the int8 codes and writing
the weights in the model dtype (``dequantize(..., out=)`` straight into the prefill's weight scratch).

Shape letters: R rows, S super-blocks of 256 values of K per row, G groups of a super-block (8 of 32, or 16 of 16).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from hetmoe.cpu.layout import GRIDS, ROWS, SUPER_BLOCK

TYPES = tuple(GRIDS)  # iq2_xxs, ...: the engine's names (hetmoe/cpu/layout.py GRIDS)
CHUNKS = SUPER_BLOCK // 8  # int64 words of 8 codes per super-block
ONES = 0x0101010101010101  # a 1 in every byte
HAS_D = {book: file_bytes > row_bytes for book, (_, row_bytes, file_bytes) in GRIDS.items()}  # IQ1_M: d in scales


def group_of(book: str) -> int:
    """Values of K per scale of grid type ``book``: 32 or 16."""
    return GRIDS[book][0]


def row_bytes(book: str) -> int:
    """Bytes of one row's block as the engine holds it: the file's block less its fp16 d (IQ1_M: whole)."""
    return GRIDS[book][1]


def _words(values, width: int) -> torch.Tensor:
    """int8 values [n, width] (numpy) -> one int64 (width 8) or int32 (width 4) word each, value j in byte j."""
    import numpy as np

    packed = np.ascontiguousarray(np.asarray(values, dtype=np.int8).reshape(-1, width))
    return torch.from_numpy(packed.view(np.int64 if width == 8 else np.int32).reshape(-1).copy())


@functools.lru_cache(maxsize=None)
def tables(book: str, device: torch.device) -> dict:
    """Grid type ``book``'s lookup tables on ``device`` (made once per device, then only read): "grid" its entries
    as words (IQ2_*: int64 [entries]; IQ3_*: int32 [entries] of 4 values; IQ1_*: int64 [2, entries] of 8 g + 1, then
    8 g - 1), "signs" int64 [256] the sign mask of each sign byte, "signs7" int64 [128] that of each 7-bit sign
    index (its parity the eighth sign: llama.cpp's ksigns_iq2xs)."""
    import numpy as np
    from gguf import quants

    if book not in TYPES:
        raise ValueError(f"{book!r} is not a grid type ({', '.join(TYPES)})")
    cls = getattr(quants, book.upper())
    cls.init_grid()
    width = cls.grid_shape[1]
    grid = np.rint(np.asarray(cls.grid, dtype=np.float32).reshape(-1, width)).astype(np.int8)
    if book.startswith("iq1"):
        grid = np.stack([8 * grid + 1, 8 * grid - 1])
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1  # [256, 8]: bit j of s
    masks = _words(-bits, 8)  # byte j 0xFF where bit j is set
    parity = bits[:128, :7].sum(1) & 1
    signs7 = masks[torch.from_numpy(np.arange(128) | (parity << 7))]
    out = {"grid": _words(grid, width).view(*grid.shape[:-2], -1) if book.startswith("iq1") else _words(grid, width),
           "signs": masks, "signs7": signs7}
    return {k: v.to(device) for k, v in out.items()}


def _u16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2 n] -> int32 [..., n]: little-endian uint16 words."""
    b = b.int()
    return b[..., 0::2] | (b[..., 1::2] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 n] -> int64 [..., n]: little-endian uint32 words."""
    b = b.long()
    return b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)


def _signed(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Words of 8 grid values (each >= 1) negated where byte j of the mask m is 0xFF (grid.h with_mask)."""
    return (g ^ m) + (m & ONES)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> int32 [..., 2 n]: each byte's low nibble, then its high one."""
    b = b.int()
    return torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)


def _shifted(v: torch.Tensor, shifts, mask: int) -> torch.Tensor:
    """v [..., n] -> [..., n * len(shifts)]: (v >> shift) & mask for each shift, a word's fields in order."""
    s = torch.tensor(shifts, dtype=v.dtype, device=v.device)
    return ((v.unsqueeze(-1) >> s) & mask).flatten(-2)


def decode(blocks: torch.Tensor, d: Optional[torch.Tensor], book: str) -> tuple:
    """Rows of grid blocks -> (codes int8 [R, S * 256], scales fp32 [R, S * G]): ``blocks`` uint8 [R, S, row_bytes]
    (each row's blocks less their fp16 d: ``row_bytes(book)``; IQ1_M's whole), ``d`` their fp16 d as fp32 [R, S]
    (None for IQ1_M, whose d is in its scale words). The codes and scales the CPU kernels multiply (grid.h
    decode_super), on ``blocks``' device."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != row_bytes(book):
        raise ValueError(f"{book} blocks must be uint8 [rows, super-blocks, {row_bytes(book)}], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    if HAS_D[book] != (d is not None) or (d is not None and tuple(d.shape) != tuple(blocks.shape[:2])):
        raise ValueError(f"{book} blocks take " + (f"their d as fp32 {list(blocks.shape[:2])}" if HAS_D[book] else
                                                   "no d (it is in their scale words)"))
    t = tables(book, blocks.device)
    R, S, _ = blocks.shape
    b = blocks
    if book in ("iq2_xxs", "iq3_xxs"):  # 8 groups of 32: index bytes (IQ3: apart), then a uint32 of 4 sign indices
        if book == "iq2_xxs":  # and a 4-bit scale; IQ2_XXS: per group 4 index bytes then its uint32
            q = b.view(R, S, 8, 8)
            aux = _u32(q[..., 4:]).view(R, S, 8)
            g = t["grid"][q[..., :4].long()].view(R, S, CHUNKS)
        else:  # IQ3_XXS: 64 index bytes of 4-value entries, then the 8 uint32
            aux = _u32(b[..., 64:96])
            g = t["grid"][b[..., :64].long()].view(torch.int64)
        words = _signed(g, t["signs7"][_shifted(aux, (0, 7, 14, 21), 127)])
        sub, unit = aux >> 28, 0.125 if book == "iq2_xxs" else 0.25
    elif book == "iq2_xs":  # 32 uint16: a 9-bit index, a 7-bit sign index; 8 bytes of two 4-bit scales
        v = _u16(b[..., :64])
        words = _signed(t["grid"][(v & 511).long()], t["signs7"][(v >> 9).long()])
        sub, unit = _nibbles(b[..., 64:72]), 0.125
    elif book == "iq2_s":  # 32 low index bytes, 32 sign bytes, 8 bytes of 2-bit high indices, 8 of scales
        idx = b[..., :32].int() | (_shifted(b[..., 64:72].int(), (0, 2, 4, 6), 3) << 8)
        words = _signed(t["grid"][idx.long()], t["signs"][b[..., 32:64].long()])
        sub, unit = _nibbles(b[..., 72:80]), 0.125
    elif book == "iq3_s":  # 64 low index bytes, 8 bytes of their high bits, 32 sign bytes, 4 bytes of scales
        idx = b[..., :64].int() | (_shifted(b[..., 64:72].int(), tuple(range(8)), 1) << 8)
        g = t["grid"][idx.long()].view(torch.int64)
        words = _signed(g, t["signs"][b[..., 72:104].long()])
        sub, unit = _nibbles(b[..., 104:108]), 1.0
    elif book == "iq1_s":  # 32 low index bytes; 8 uint16 of four 3-bit high indices, a 3-bit scale, the delta sign
        h = _u16(b[..., 32:48])
        idx = b[..., :32].int() | (_shifted(h, (0, 3, 6, 9), 7) << 8)
        neg = (h >> 15).repeat_interleave(4, dim=-1)
        words = t["grid"].view(-1)[(idx + (neg << 11)).long()]
        sub, unit = (h >> 12) & 7, 0.125
    elif book == "iq1_m":  # 32 low index bytes; 16 bytes of (3-bit high index, delta sign) nibbles; 4 scale words
        nib = _nibbles(b[..., 32:48])
        idx = b[..., :32].int() | ((nib & 7) << 8)
        words = t["grid"].view(-1)[(idx + ((nib >> 3) << 11)).long()]
        sc = _u16(b[..., 48:56])  # [R, S, 4]: four 3-bit scales each, their top nibbles the fp16 d
        sub, unit = _shifted(sc, (0, 3, 6, 9), 7), 0.125
        bits = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000)
        d = bits.to(torch.int16).view(torch.float16).float()
    else:
        raise ValueError(f"{book!r} is not a grid type ({', '.join(TYPES)})")
    scales = d.unsqueeze(-1) * (2 * sub + 1).float() * unit  # exact: 11 + 5 significant bits, times a power of two
    return words.reshape(R, S * CHUNKS).view(torch.int8), scales.reshape(R, -1)


def dequantize(blocks: torch.Tensor, d: Optional[torch.Tensor], book: str, dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of grid blocks (``decode``'s arguments) -> their weights [R, S * 256]: scale * q in fp32 (exact), rounded
    once to ``dtype`` (or ``out``'s, written in place: a contiguous [R, S * 256])."""
    codes, scales = decode(blocks, d, book)
    R, K = codes.shape
    G = scales.shape[1]
    if out is None:
        out = torch.empty(R, K, dtype=dtype, device=codes.device)
    elif not out.is_contiguous() or out.numel() != R * K:
        raise ValueError(f"out must be a contiguous [{R}, {K}], got {list(out.shape)}")
    torch.mul(codes.view(R, G, K // G), scales.unsqueeze(-1), out=out.view(R, G, K // G))
    return out.view(R, K)


def engine_rows(data: torch.Tensor, scales: Optional[torch.Tensor], book: str, n_blocks: int, k: int, mats: int,
                rows: int) -> tuple:
    """A grid matrix's bytes in the engine's row blocks (csrc/formats/layout.h: per row block, [S][16 rows]
    [row_bytes] of data and [S][16] fp16 d) -> ``decode``'s (blocks [n * mats * rows, S, row_bytes], d fp32 or None):
    ``data`` uint8 holding n experts' ``mats`` matrices of ``n_blocks`` row blocks each, interleaved per row block
    (gate/up: mats = 2, gate's row block then up's), ``scales`` their d bytes in the same order (IQ1_M: None),
    padded rows cut to ``rows``. Rows come out expert by expert, matrix by matrix (gate rows, then up rows)."""
    S, rb = k // SUPER_BLOCK, row_bytes(book)
    n = data.numel() // (n_blocks * mats * S * ROWS * rb)
    blocks = data.view(n, n_blocks, mats, S, ROWS, rb).permute(0, 2, 1, 4, 3, 5)
    blocks = blocks.reshape(n, mats, n_blocks * ROWS, S, rb)[:, :, :rows].reshape(n * mats * rows, S, rb)
    if not HAS_D[book]:
        return blocks, None
    d = scales.view(n, n_blocks, mats, S, ROWS, 2).permute(0, 2, 1, 4, 3, 5)
    d = d.reshape(n, mats, n_blocks * ROWS, S, 2)[:, :, :rows].contiguous().view(torch.float16)
    return blocks, d.reshape(n * mats * rows, S).float()


def file_rows(raw: torch.Tensor, book: str) -> tuple:
    """A GGUF file's blocks of grid type ``book``, uint8 [R, S * file bytes per block] -> ``decode``'s (blocks, d)."""
    _, rb, fb = GRIDS[book]
    b = raw.reshape(raw.shape[0], -1, fb)
    if not HAS_D[book]:
        return b.contiguous(), None
    d = b[..., :2].contiguous().view(torch.float16)[..., 0].float()
    return b[..., 2:].contiguous(), d
