// Packing weights into the layout of layout.h, and unpacking them (for tests and the dequantized reference).
#pragma once
#include <cstdint>

#include "formats/layout.h"

namespace hetmoe {

// Packs row block `rb` of w (fp32 [s.n][s.k], row-major) into data (s.block_bytes()) and scales
// (s.block_scales() floats). int8: absmax scale per (row, group). int4: the scale minimising squared error
// over a small set of candidates, then refitted by least squares.
void pack_row_block(const MatrixShape& s, const float* w, int rb, uint8_t* data, float* scales);

// The inverse: fp32 [s.n][s.k] values the kernels actually multiply by.
void unpack_row_block(const MatrixShape& s, const uint8_t* data, const float* scales, int rb, float* w);

}  // namespace hetmoe
