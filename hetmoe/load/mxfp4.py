"""MXFP4 as Hugging Face checkpoints store it (gpt-oss: quantization_config quant_method "mxfp4"), read as the codes
and scales the expert engine's lut4 format holds exactly (hetmoe/cpu/codes.py, csrc/formats/layout.h).

A matrix [N, K] (out x in) is ``<name>_blocks`` uint8 [.., N, K / 32, 16] and ``<name>_scales`` uint8 [.., N, K / 32]:
byte j of a block holds value 2j in its low nibble and value 2j + 1 in its high one (transformers'
integrations/mxfp4.py: ``lut[blk & 0x0F]`` to the even columns, ``lut[blk >> 4]`` to the odd ones), each nibble an
E2M1 index into (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, ..., -6); the scale byte s is the E8M0 exponent, value =
E2M1[q] * 2^(s - 127). The engine's e2m1 codebook holds the E2M1 values doubled (integers), so its scale is
2^(s - 128), which its e8m0 scale type stores as the byte s itself: the codes and scale bytes go in unchanged, 17
bytes per 32 values as in the file. A scale byte of 255 (2^128: not finite) is refused.

DeepSeek-V4 stores its routed experts so too (config.json ``expert_dtype: "fp4"``), a matrix per expert: ``<m>.weight``
int8 [N, K / 2] (the same bytes as a gpt-oss block row: byte j holds value 2j low, 2j + 1 high) and its scale
``<m>.scale`` E8M0 (F8_E8M0 or uint8) [N, K / 32]; ``packed_codes`` reads those bytes as blocks.
"""

from __future__ import annotations

import torch

from hetmoe.cpu.layout import CODEBOOKS
from hetmoe.load.compressed import nibbles

BLOCK = 32  # values per scale
BLOCK_BYTES = 16  # nibble bytes per block


def check_pair(name: str, blocks_shape: tuple, scales_shape: tuple) -> None:
    """ValueError unless ``<name>_blocks`` [.., N, G, 16] uint8 and ``<name>_scales`` [.., N, G] go together."""
    if len(blocks_shape) < 3 or blocks_shape[-1] != BLOCK_BYTES or tuple(scales_shape) != tuple(blocks_shape[:-1]):
        raise ValueError(f"{name}_blocks {list(blocks_shape)} and {name}_scales {list(scales_shape)} are not MXFP4 "
                         f"blocks [.., N, K/{BLOCK}, {BLOCK_BYTES}] with one scale [.., N, K/{BLOCK}] each")


def check_packed(name: str, weight_shape: tuple, scale_shape: tuple) -> None:
    """ValueError unless DeepSeek-V4's ``name`` int8 [N, K / 2] and its scale [N, K / 32] go together."""
    if len(weight_shape) != 2 or tuple(scale_shape) != (weight_shape[0], weight_shape[1] * 2 // BLOCK) \
            or weight_shape[1] % BLOCK_BYTES:
        raise ValueError(f"{name} {list(weight_shape)} and its scale {list(scale_shape)} are not FP4 (E2M1) codes "
                         f"[N, K/2] with one E8M0 scale per {BLOCK} values [N, K/{BLOCK}]")


def packed_codes(weight: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's FP4 bytes [.., N, K / 2] (int8 or uint8) -> int8 E2M1 indices [.., N, K]."""
    b = weight.contiguous().view(torch.uint8)
    return codes(b.reshape(*b.shape[:-1], b.shape[-1] // BLOCK_BYTES, BLOCK_BYTES))


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [.., N, G, 16] -> int8 E2M1 indices [.., N, G * 32] (the low nibble of byte j is value 2j)."""
    return nibbles(blocks.to(torch.uint8)).reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).view(torch.int8)


def engine_scales(scales: torch.Tensor, name: str = "MXFP4 weight") -> torch.Tensor:
    """E8M0 scale bytes [.., N, G] -> the engine's lut4 e2m1 scales fp32 2^(s - 128) (exact; s = 0 and 1 are the fp32
    subnormals 2^-128, 2^-127). ValueError for the byte 255."""
    s = scales.contiguous().view(torch.uint8).to(torch.int32)  # (F8_E8M0 scales: their bytes)
    if s.numel() and int(s.max()) == 255:
        raise ValueError(f"{name} has the E8M0 scale byte 255 (2^128: not a finite scale)")
    bits = torch.where(s < 2, torch.tensor(0x00200000, dtype=torch.int32) << s, (s - 1) << 23)
    return bits.view(torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "MXFP4 weight") -> torch.Tensor:
    """The values [.., N, K] in ``dtype``: doubled E2M1 value x 2^(s - 128), computed in fp32 (exact)."""
    q = codes(blocks).long()
    book = torch.tensor(CODEBOOKS["e2m1"], dtype=torch.float32)
    s = engine_scales(scales, name).repeat_interleave(BLOCK, dim=-1)
    return (book[q] * s).to(dtype)
