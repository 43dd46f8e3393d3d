// Packing weights into the layout of layout.h, and unpacking them (for tests and the dequantized reference).
#pragma once
#include <cstdint>

#include "formats/layout.h"

namespace hetmoe {

// Packs row block `rb` of w (fp32 [s.n][s.k], row-major) into data (s.block_bytes()) and scales
// (s.block_scale_bytes()). int8: absmax scale per (row, group). int4: the scale minimising squared error
// over a small set of candidates, then refitted by least squares. Affine: the group's range with 0, min = -lowest.
// lut4: the scale mapping the group's largest |w| to the codebook's largest |value|, each w to the nearest entry.
// fp8: the scale mapping the group's (shared scales: the block's group's) largest |w| to 448, each w / scale rounded
// to the nearest E4M3 code.
// Scales stored narrower than fp32 are rounded to their type (e8m0: up to a power of two) before the codes.
void pack_row_block(const MatrixShape& s, const float* w, int rb, uint8_t* data, uint8_t* scales);

// Packs row block `rb` from codes quantized already (GGUF's Q8_0 / Q4_0 / Q4_1 / Q5 / K-quant / IQ4 / FP4 blocks):
// q [s.n][s.k] and one fp32 scale per (row, group), group_scales [s.n][s.n_groups()]; affine shapes also one min per
// (row, group), group_mins (same shape; ignored when symmetric), stored in the shape's scale type as the scales are
// (k8 / k4: each super-block's values split into sub-scales and an fp16 super scale; zero-point types: each min as
// one int8 z, min = fl(scale * z); store_row_set). Code ranges:
// symmetric int8 [-127, 127], int4 [-8, 7]; affine int8 [0, 127], int4 [0, 15]; lut4 the codebook index [0, 15]. The
// values the kernels multiply by are then exactly q * scale (lut4: codebook[q] * scale; affine: fl(fl(scale * q) -
// min), as gguf's K-quant dequantization): nothing is re-quantized. Grouped int8/int4/lut4 only (not per-row, not
// bf16). Returns false when a code is out of its range, a scale or min is not finite, or a scale or min has no exact
// form in the shape's scale type (the block is then garbage). e4m3 / e4m3_div scales (layout.h): `factor` is the
// matrix's per-tensor scale f, and each scale must be the exact fl(e4m3(b) * f) / 2 (fl(e4m3(b) / f) / 2) of some
// byte b (false otherwise, or for f not finite and > 0 once stored); the other types ignore it.
bool pack_row_block_codes(const MatrixShape& s, const int8_t* q, const float* group_scales, const float* group_mins,
                          int rb, uint8_t* data, uint8_t* scales, float factor = 1.f);

// Writes the block factor of a factor_scales shape (layout.h e4m3, e4m3_div) for the per-tensor scale f into a
// block's scale bytes (nothing for other types). store_row_set stores the set's bytes at that factor.
void set_block_factor(const MatrixShape& s, uint8_t* scales, float f);

// Packs row block `rb` of an fp8 matrix from E4M3 codes as a checkpoint stores them, codes [s.n][s.k] (bytes), and
// one scale per (row, group), group_scales [s.n][s.n_groups()] (shared scales: the same for the 16 rows of a block,
// stored once). The values the kernels multiply by are then exactly e4m3(code) * scale. Grouped fp8 only (a per-row
// scale goes in as group 128, each group's the row's). Returns false when a code is a NaN (0x7F, 0xFF), a scale has
// no exact form in the shape's scale type (or is not finite), or, shared, a block's rows have different scales.
bool pack_row_block_fp8(const MatrixShape& s, const uint8_t* codes, const float* group_scales, int rb, uint8_t* data,
                        uint8_t* scales);

// Packs row block `rb` of a grid matrix (formats/layout.h) from its GGUF i-quant blocks as the file stores them:
// raw [s.n][s.n_supers()] blocks of grid_file_bytes(s.codebook) bytes (row-major). The bytes are moved, not decoded:
// each block's fp16 d into the scale set, the rest into the row's place in the data. Returns false when a d is not
// finite (the block is then garbage).
bool pack_row_block_grid(const MatrixShape& s, const uint8_t* raw, int rb, uint8_t* data, uint8_t* scales);

// Writes the per-group values v[0..s.n_groups()) of row r of a block into one of its scale sets (mins false: the
// scales, true: the affine mins) in the shape's scale type; `scales` is the block's scale bytes
// (s.block_scale_bytes(): the scale set, then the min set). exact: true when every value is stored as it is (k8 / k4:
// every super-block splits exactly into sub-scales x fp16), false otherwise. Not exact: each value rounded to the
// nearest the type holds (e8m0 up to a power of two, e4m3 / e4m3_div up to a byte's scale at the block's factor; k8 /
// k4 a super scale at or above max |v| / 127 (k4: / 15), the sub-scales rounded), the stored values written back into
// v, always true. k4's scales and mins share their pair bytes: each call writes its own nibble. A zero-point type's
// min set (f32_zp, f16_zp, bf16_zp) holds z with min = fl(scale * z) against the row's scales stored already: exact,
// the z in [-128, 127] that gives each min bit for bit (false where none does); not exact, z the nearest integer to
// min / scale (0 where the scale is 0), clamped to the range.
bool store_row_set(const MatrixShape& s, float* v, int r, uint8_t* scales, bool mins, bool exact);

// Scale v of a group quantized from floats, stored in type t at dst: the nearest value t holds (e8m0: the next power
// of two up, so that no code is clipped; e4m3 / e4m3_div: up, at the factor f = 1), which is returned for the codes.
float store_scale_rounded(ScaleType t, float v, uint8_t* dst);

// The inverse: fp32 [s.n][s.k] values the kernels actually multiply by.
void unpack_row_block(const MatrixShape& s, const uint8_t* data, const uint8_t* scales, int rb, float* w);

}  // namespace hetmoe
