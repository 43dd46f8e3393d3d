// Packing weights into the layout of layout.h, and unpacking them (for tests and the dequantized reference).
#pragma once
#include <cstdint>

#include "formats/layout.h"

namespace hetmoe {

// Packs row block `rb` of w (fp32 [s.n][s.k], row-major) into data (s.block_bytes()) and scales
// (s.block_scales() floats). int8: absmax scale per (row, group). int4: the scale minimising squared error
// over a small set of candidates, then refitted by least squares. Affine: the group's range with 0, min = -lowest.
void pack_row_block(const MatrixShape& s, const float* w, int rb, uint8_t* data, float* scales);

// Packs row block `rb` from codes quantized already (GGUF's Q8_0 / Q4_0 / K-quant blocks): q [s.n][s.k] and one
// scale per (row, group), group_scales [s.n][s.n_groups()]; affine shapes also one min per (row, group),
// group_mins (same shape; ignored when symmetric). Code ranges: symmetric int8 [-127, 127], int4 [-8, 7]; affine
// int8 [0, 127], int4 [0, 15]. The values the kernels multiply by are then exactly q * scale (affine:
// fl(fl(scale * q) - min), as gguf's K-quant dequantization): nothing is re-quantized. Grouped int8/int4 only (not
// per-row, not bf16). Returns false when a code is out of its range or a scale or min is not finite (the block is
// then garbage).
bool pack_row_block_codes(const MatrixShape& s, const int8_t* q, const float* group_scales, const float* group_mins,
                          int rb, uint8_t* data, float* scales);

// The inverse: fp32 [s.n][s.k] values the kernels actually multiply by.
void unpack_row_block(const MatrixShape& s, const uint8_t* data, const float* scales, int rb, float* w);

}  // namespace hetmoe
