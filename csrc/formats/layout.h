// The packed weight layout: the one contract between packing (pack.cpp) and every micro-kernel.
//
// A weight matrix W [N, K] (Hugging Face out x in: gate/up are [I, H], down is [H, I]) is stored as
// ceil(N / 16) row blocks of 16 rows. A row block is contiguous and 64-byte aligned; inside it, K is walked in
// 64-byte lines, and every line holds the same 4-byte slice of K for each of the 16 rows:
//
//     line j, bytes [4n, 4n + 4) = row n of the block, elements k in [j*kpl, (j+1)*kpl)     (kpl = K per line)
//
//   bf16: kpl = 2   the two bf16 values of k = 2j, 2j+1 (low half = even k)
//   int8: kpl = 4   four bytes k = 4j..4j+3, stored as unsigned (q + 128), q in [-127, 127]
//   int4: kpl = 8   byte b holds k = 8j+b in its low nibble and k = 8j+4+b in its high nibble, stored as
//                   unsigned (q + 8), q in [-8, 7]
//
// Scaling (int8/int4) is symmetric (above: value = scale * q) or affine (GGUF's K-quants): value = scale * u - min
// with u the stored byte / nibble itself (int8: 0..255, int4: 0..15; no implied offset) and one fp32 min per
// (row, group) beside the scale. Kernels undo both forms with the activation's per-group element sum:
//     symmetric: acc = fma(float(isum - offset * xsum), scale * x_scale, acc)                (offset 128 / 8)
//     affine:    acc = fma(float(isum), scale * x_scale, acc); acc = fma(float(-xsum), min * x_scale, acc)
// in that order on every ISA, so every path of one format gives the same bits.
//
// A line is one 512-bit register (16 rows x 32 bits): the layout AVX-512 VNNI/BF16 dot products and the AMX
// B-tile format (16 lines = one 1 KB tile) read directly, so no kernel repacks at run time.
//
// K is zero-padded to a multiple of the group size (bf16 uses 32), N to a multiple of 16. Padding is zero in
// value (128 for int8, 8 for int4; affine: code 0 with scale and min 0 in padded rows, and padded K meets zero
// activations) so it contributes nothing to dot products.
//
// Scales (int8/int4) live apart from the lines, one fp32 per (row, group), laid out [row block][group][16 rows],
// so the 16 scales a kernel needs at the end of a group are one contiguous 64-byte vector. Affine blocks hold
// their mins right after their scales, in the same [group][16 rows] order.
//
// Groups: 32, 64 or 128 elements of K (int8 also 16, for GGUF's Q6_K), or per row (int8 and int4, symmetric: one
// scale per row, stored repeated in every group of 128, so every kernel reads it as a grouped matrix).
//
// Activations are quantized once per layer into "activation rows" (ActRow below) whose element type follows
// the weight format: fp32 for bf16 weights, int16 for int8 weights, int8 for int4 weights, each with one fp32
// scale and one int32 element sum per group (the sum undoes the unsigned offset of the weights).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace hetmoe {

enum class WeightFormat : int { bf16 = 0, int8 = 1, int4 = 2 };

// How int8/int4 codes become values (see the top of this file). bf16 ignores it.
enum class Scaling : int { symmetric = 0, affine = 1 };

// Bumped whenever the packed bytes of any format change: converted-expert caches of another version are rebuilt.
constexpr int kLayoutVersion = 1;

constexpr int kRowsPerBlock = 16;
constexpr int kLineBytes = 64;
constexpr int kBf16Group = 32;  // K padding unit for bf16, which has no scales

static_assert(kRowsPerBlock * 4 == kLineBytes, "a line is 16 rows x 4 bytes");

inline int k_per_line(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return 2;
    case WeightFormat::int8: return 4;
    case WeightFormat::int4: return 8;
  }
  return 0;
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Geometry of one packed matrix [N, K].
struct MatrixShape {
  WeightFormat format;
  int n;         // rows (outputs)
  int k;         // columns (inputs)
  int group;     // elements of K per scale (bf16: kBf16Group, no scales)
  int kp;        // K padded to the group size
  int n_blocks;  // row blocks of 16
  bool per_row;  // int8/int4: one scale per row, stored repeated in every group of 128
  Scaling scaling;

  // group <= 0 with int8 or int4 means per-row scales (symmetric only).
  static MatrixShape make(WeightFormat f, int n, int k, int group, Scaling scaling = Scaling::symmetric) {
    MatrixShape s;
    s.per_row = f != WeightFormat::bf16 && group <= 0;
    if (s.per_row) group = 128;
    s.scaling = f == WeightFormat::bf16 ? Scaling::symmetric : scaling;
    s.format = f;
    s.n = n;
    s.k = k;
    s.group = f == WeightFormat::bf16 ? kBf16Group : group;
    s.kp = (int)round_up(k, s.group);
    s.n_blocks = (int)((n + kRowsPerBlock - 1) / kRowsPerBlock);
    return s;
  }
  int n_groups() const { return kp / group; }
  int lines_per_block() const { return kp / k_per_line(format); }
  size_t block_bytes() const { return (size_t)lines_per_block() * kLineBytes; }
  size_t data_bytes() const { return block_bytes() * n_blocks; }
  bool has_scales() const { return format != WeightFormat::bf16; }
  bool affine() const { return scaling == Scaling::affine; }
  // floats of one block's scales (and, affine, its mins after them)
  size_t block_scales() const { return has_scales() ? (size_t)n_groups() * kRowsPerBlock * (affine() ? 2 : 1) : 0; }
  size_t scale_bytes() const { return block_scales() * n_blocks * sizeof(float); }
};

// What the micro-kernel reads for one row block.
struct RowBlock {
  const uint8_t* data;  // block_bytes(), 64-byte aligned
  const float* scales;  // [n_groups][16] or nullptr for bf16
  int kp;
  int group;
  const float* mins = nullptr;  // affine: [n_groups][16] (right after the scales); symmetric: nullptr

  // The block of shape s whose data and scales (s.block_scales() floats) start at these addresses.
  static RowBlock at(const MatrixShape& s, const uint8_t* data, const float* scales) {
    RowBlock b;
    b.data = data;
    b.scales = s.has_scales() ? scales : nullptr;
    b.kp = s.kp;
    b.group = s.group;
    b.mins = s.affine() ? scales + (size_t)s.n_groups() * kRowsPerBlock : nullptr;
    return b;
  }
};

// Activation row for one token: [kp] elements, then per group one fp32 scale and one int32 sum.
// bf16 weights: fp32 elements, scales = 1, sums = 0 (unused). Rows are padded to 64 bytes.
inline size_t act_elem_bytes(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return 4;
    case WeightFormat::int8: return 2;
    case WeightFormat::int4: return 1;
  }
  return 0;
}

// AMX tiles multiply bf16 x bf16 and int8 x int8 only, so experts computed with AMX read narrower activations:
// bf16 for bf16 weights, int8 (groups as above, qmax 127) for int8 and int4 weights. `group` > 0 overrides the
// matrix's group for per-row int8/int4 weights, whose AMX GEMM sums a whole activation group in the tiles before
// its one fp32 epilogue (kernels/amx/gemm.h): x gets one group over the whole row (one scale per token), h groups
// of amx_row_group(I) (the NUMA split cuts I at multiples of it, so slices round h as the unsplit engine does).
// Same row layout otherwise; the GEMM reads these rows from an AmxPanel (below), which stores them as its A tiles.
inline size_t act_elem_bytes_amx(WeightFormat f) { return f == WeightFormat::bf16 ? 2 : 1; }

struct ActLayout {
  int kp;
  int group;
  size_t elem_bytes;
  size_t scales_off;  // byte offset of the fp32 scales
  size_t sums_off;    // byte offset of the int32 sums
  size_t row_bytes;   // 64-byte multiple

  static ActLayout make(const MatrixShape& s, bool amx = false, int group = 0) {
    ActLayout a;
    a.kp = s.kp;
    a.group = group > 0 ? group : s.group;  // a divisor of kp
    a.elem_bytes = amx ? act_elem_bytes_amx(s.format) : act_elem_bytes(s.format);
    const int64_t n_groups = s.kp / a.group;
    a.scales_off = (size_t)round_up((int64_t)s.kp * a.elem_bytes, 64);
    a.sums_off = a.scales_off + (size_t)round_up(n_groups * 4, 64);
    a.row_bytes = a.sums_off + (size_t)round_up(n_groups * 4, 64);
    return a;
  }
};

// The activations an AMX GEMM reads, stored as its A tiles ("panel"). Rows (one per token and expert) come in
// blocks of 16, and each expert's rows start a new block. Inside a block the 16 rows' elements (the element part
// of an ActLayout row, scales_off bytes) are cut in 64-byte pieces, and piece c of all 16 rows is one contiguous
// 1 KB tile at block + c * 1024 (row m at + m * 64): a tile load reads 16 consecutive cache lines, not 16 lines a
// row apart. Each row's scales and sums (the rest of the ActLayout row, same offsets relative to scales_off)
// live in `meta`, meta_bytes per row.
struct AmxPanel {
  uint8_t* tiles = nullptr;
  uint8_t* meta = nullptr;
  size_t block_bytes = 0;  // 16 * scales_off
  size_t meta_bytes = 0;   // row_bytes - scales_off
  size_t sums_rel = 0;     // sums_off - scales_off

  static AmxPanel make(const ActLayout& a, uint8_t* tiles, uint8_t* meta) {
    AmxPanel p;
    p.tiles = tiles;
    p.meta = meta;
    p.block_bytes = 16 * a.scales_off;
    p.meta_bytes = a.row_bytes - a.scales_off;
    p.sums_rel = a.sums_off - a.scales_off;
    return p;
  }
  // Bytes of a panel of n_rows rows (a multiple of 16): tiles, then meta.
  static size_t tile_bytes(const ActLayout& a, int64_t n_rows) { return (size_t)n_rows * a.scales_off; }
  static size_t meta_bytes_of(const ActLayout& a, int64_t n_rows) {
    return (size_t)n_rows * (a.row_bytes - a.scales_off);
  }

  // Byte `byte` of row `row`'s elements; the 16 rows of a tile follow at a stride of 64 bytes.
  uint8_t* at(int64_t row, size_t byte) const {
    return tiles + (size_t)(row / 16) * block_bytes + (byte / 64) * 1024 + (size_t)(row % 16) * 64 + byte % 64;
  }
  const float* scales(int64_t row) const { return reinterpret_cast<const float*>(meta + (size_t)row * meta_bytes); }
  const int32_t* sums(int64_t row) const {
    return reinterpret_cast<const int32_t*>(meta + (size_t)row * meta_bytes + sums_rel);
  }
  // The same panel from row `row0` (a multiple of 16) on.
  AmxPanel from(int64_t row0) const {
    AmxPanel p = *this;
    p.tiles = tiles + (size_t)(row0 / 16) * block_bytes;
    p.meta = meta + (size_t)row0 * meta_bytes;
    return p;
  }
  // Row `row` := an ActLayout activation row (`elem_bytes` = a.scales_off), or zeros when src is null.
  void store(int64_t row, const uint8_t* src, size_t elem_bytes) const {
    for (size_t c = 0; c < elem_bytes; c += 64) {
      uint8_t* dst = at(row, c);
      if (src)
        std::memcpy(dst, src + c, 64);
      else
        std::memset(dst, 0, 64);
    }
    uint8_t* m = meta + (size_t)row * meta_bytes;
    if (src)
      std::memcpy(m, src + elem_bytes, meta_bytes);
    else
      std::memset(m, 0, meta_bytes);
  }
};

// The AMX activation group of h (K of the down matrix) for per-row int8/int4 weights with intermediate size I: the
// largest of 1024, 512, 256 that divides I padded to 128 at least twice (a NUMA split into two stays possible),
// else 128. Longer groups mean fewer epilogues in the GEMM.
inline int amx_row_group(int intermediate) {
  const int64_t kp = round_up(intermediate, 128);
  for (int g = 1024; g > 128; g /= 2)
    if (kp % g == 0 && kp / g >= 2) return g;
  return 128;
}

}  // namespace hetmoe
