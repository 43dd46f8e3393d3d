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
//   lut4: kpl = 8   the nibbles of int4, each an index i (0..15) into the matrix's codebook: q = codebook[i]
//   fp8:  kpl = 4   four bytes k = 4j..4j+3, each an E4M3 code (OCP FP8: sign, 4 exponent bits of bias 7, 3 mantissa
//                   bits; q = the value it encodes, |q| <= 448), as the checkpoint stores it
//
// lut4 ("4-bit lookup") holds the 4-bit types whose 16 levels are not evenly spaced, at their own bytes: the FP4
// element E2M1 of MXFP4 / NVFP4 (its values doubled into the integers 0, 1, 2, 3, 4, 6, 8, 12 and their negatives;
// the 1/2 is in the scale) and the IQ4_NL table of llama.cpp (kvalues_iq4nl, -127..113; IQ4_NL and IQ4_XS). A
// codebook is 16 int8 values, so the kernels compute with lut4 what they compute with symmetric int8 codes: each
// nibble is looked up (one byte shuffle per 16 or 64 nibbles), the dot product with the int8 activation is exact in
// int32, and the epilogue is the symmetric one. It is a format of its own, not int4 with a table, because its kernels
// differ in code (the lookup) while every codebook is the same code reading other data: the codebook is a field of
// the matrix (Codebook below), the kernel the table's (format, ISA) row.
//
// Scaling (int8/int4/lut4) is symmetric (above: value = scale * q) or affine (GGUF's K-quants, Q4_1, Q5_1; int8/int4
// only): value = scale * u - min with u the stored byte / nibble itself (int8: 0..255, int4: 0..15; no implied
// offset) and one min per (row, group) beside the scale. Kernels undo both forms with the activation's per-group
// element sum:
//     symmetric: acc = fma(float(isum - offset * xsum), scale * x_scale, acc)          (offset 128 / 8; lut4: 0)
//     affine:    acc = fma(float(isum), scale * x_scale, acc); acc = fma(float(-xsum), min * x_scale, acc)
// in that order on every ISA, so every path of one format gives the same bits. (isum is the exact integer sum of
// q * x over the group however a kernel forms it: lut4 on AVX-512 looks up q + 128 as unsigned bytes and subtracts
// 128 * xsum, on AVX2 multiplies signed bytes, on AMX expands tiles of signed q.)
//
// fp8 holds the E4M3 experts of FP8 checkpoints at their own bytes: block FP8 (one fp32 scale per 128 x 128 block:
// DeepSeek-V3, GLM, Qwen-FP8; shared scales below), per-channel FP8 (one fp32 scale per row) and MXFP8 (one E8M0
// scale per 32 of K). The kernels widen codes to floats in registers and multiply fp32 activations with fp32 FMAs, so
// the stream stays at one byte per weight, the checkpoint's. A code becomes an IEEE half with integer ops (its sign
// to bit 15, its other 7 bits to bits 7..13: the half of value q * 2^-8, subnormals included) and the half an fp32
// with vcvtph2ps (F16C), exact, with no fp32 subnormal anywhere (an arithmetic widening would meet them: E4M3's
// subnormals, and they cost microcode assists or read as zero under DAZ). The 2^8 goes into the scale. The halves
// of a line's 16-bit words come out as rows x (k, k + 2) pairs, so fp8 activation rows (fp32) store each quad of K
// as x0 x2 x1 x3 (fp8_act_index), and four fma chains run per row, one per byte of a line (k mod 4); a group ends as
//     acc = fma((c0 + c1) + (c2 + c3), scale * 256, acc)        with c_b = sum over the group of (q * 2^-8) * x
// in that order on every ISA, so scalar, AVX2 and AVX-512 give the same bits (as bf16 does; exact but for a scale
// above 2^120 or a product below 2^-118). The AMX GEMM widens each line to two bf16 lines of q * 2^-8 (exact: 3
// mantissa bits) and multiplies bf16 activations in tiles, one fp32 epilogue per group. Dot products in bf16
// (AVX-512 BF16's vdpbf16ps) would round the activations on the row blocks too and differ between CPUs; the row
// blocks stay fp32 like bf16's. The E4M3 NaN codes (0x7F, 0xFF) are refused at packing.
//
// Bit-plane formats (int6, int5, int3, int2) hold b-bit codes at b bits each: the GGUF K-quants Q6_K, Q5_K, Q3_K
// and Q2_K at their own bytes. A code u (symmetric: q + 2^(b-1), q in [-2^(b-1), 2^(b-1) - 1]; affine: u itself, 0 ..
// 2^b - 1) is split into a low part (int6, int5: 4 bits; int3, int2: 2) and a high part (int6: 2 bits; int5, int3:
// 1; int2: none), each held in lines of its own ("planes"). K is walked in quads of 16; "byte line" f (0..3) of quad
// q is the int8 line of k = 16q + 4f .. 16q + 4f + 3 (byte e of row n: k = 16q + 4f + e), and its codes sit as
//   low 4 bits:  two nibble lines per quad, int4's bytes: line 0 holds f = 0 (low nibbles) and 1 (high), line 1
//                f = 2 and 3
//   low 2 bits:  one line per quad: bits 2f, 2f + 1 of byte e of row n
//   high 2 bits: one line per quad, as the low 2 bits (int6)
//   high 1 bit:  one line per two quads: bit 4 (q % 2) + f of byte e of row n (int5, int3)
// A unit is the lines of one quad, or of two where the high plane has 1 bit: the low lines of its quads in order,
// then its high line: int6 16 of K in 3 lines, int5 32 in 5, int3 32 in 3, int2 16 in 1 (b bits per weight, exactly).
// A kp that ends in half a unit (int5 and int3, kp an odd multiple of 16) stores the last unit whole.
// Byte line f is then ((lo >> s) & m) | (((hi >> t) & m') << low bits): one shift and one mask per plane at any
// SIMD width (16-bit shifts do: the bits kept never cross a byte), the very line the int8 / int4 kernels multiply.
// int6 and int5 read int16 activation rows as int8 does, int3 and int2 int8 rows as int4 does, and a matrix of
// either gives bit for bit the outputs of the same codes held as int8 (int6, int5) or int4 (int3, int2): the same
// integer sums, the same epilogue, with the offset 2^(b-1) of symmetric codes.
//
// grid holds GGUF's i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M; the matrix's grid type is its
// Codebook below) at their file's bytes. Each decodes to symmetric integer codes |q| <= 63 times one fp32 scale per
// group of 16 or 32 of K that is its super-block's fp16 d times a small odd integer and a power of two (formats/grid.h
// lists them), so the kernels compute with grid what they compute with lut4: int8 codes x int8 activations, exact
// int32 sums per group, the symmetric epilogue with no offset. What differs is the expansion of the stored bits (grid
// indices into the type's table of 8- or 4-value entries, sign indices or sign bytes, sub-scales), which is not a
// shift and a mask per line: the row block keeps the file's blocks whole, and a kernel decodes them a super-block at
// a time. K is whole super-blocks of 256 (kp a multiple of 256), and a row block is
//     data:   [n_supers][16 rows][row_bytes]   each row's block of that super-block less its fp16 d (IQ1_M: whole)
//     scales: [n_supers][16 rows] fp16 d       (IQ1_M: none; its d is the top nibbles of its four scale words)
// (grid_info: row_bytes 64 / 72 / 80 / 96 / 108 / 48 / 56, which with the d are the files' 66 / 74 / 82 / 98 / 110 /
// 50 / 56 bytes per 256 values; 16 x row_bytes is a multiple of 64, so every super-block starts a line). A kernel
// decodes one super-block of its 16 rows into 64 int8 lines of the signed codes (line j: k = 4j .. 4j + 3, the
// layout of an int8 block) and its [256 / group][16] fp32 scales, with the one portable decoder (formats/grid.h,
// compiled at each ISA level), then multiplies them as lut4's looked-up codes: AVX2 maddubs on |x| and q signed by x
// (AVX-512 CPUs run it too: an AVX-512 kernel waits for an AVX-512 machine to verify it), AMX tdpbssd on the signed
// lines. A grid matrix is
// loaded from the file's blocks (pack.h pack_row_block_grid), never quantized from floats; padded rows are zero bytes
// with d = 0.
//
// A line is one 512-bit register (16 rows x 32 bits): the layout AVX-512 VNNI/BF16 dot products and the AMX
// B-tile format (16 lines = one 1 KB tile) read directly, so no kernel repacks at run time.
//
// K is zero-padded to a multiple of the group size (bf16 uses 32), N to a multiple of 16. Padding contributes
// nothing to dot products: padded K holds the code of zero (128 for int8, 8 for int4; affine: code 0) or, for
// lut4, index 0 (whatever its value: IQ4_NL's is -127), for fp8 the code 0 (+0), and meets zero activations; padded
// rows have scale (and min) 0 (e8m0 has no 0: its smallest, 2^-128), and their outputs are never read.
//
// Scales (int8/int4/lut4) live apart from the lines, one per (row, group), laid out [row block][group][16 rows],
// so the 16 scales a kernel needs at the end of a group are one contiguous vector. Each matrix chooses how its
// scales are stored (ScaleType): fp32 (4 bytes), fp16 or bf16 (2), e8m0 (1 byte e: 2^(e - 128)), k8 (two levels,
// below), e4m3 / e4m3_div (1 byte and a factor per row block, below) or fp32 / fp16 / bf16 with zero points (affine:
// the scale, and a byte per min, below) — the width of the checkpoint's own scales, so a
// Q4_0 block (fp16 d + 16 bytes) costs 18 bytes here as in the file. Every kernel widens a group's 16 scales to fp32
// with one load and one conversion (vcvtph2ps for fp16, a shift for bf16, a shift and a blend for e8m0; k8: two loads,
// two conversions and a multiply; e4m3: integer ops, a conversion and a multiply by the block's factor, whose one
// rounding is the checkpoint's); the widening is exact, so the epilogue and its bits are those of fp32 scales of the
// same values. e8m0 is the MX block scale 2^(e - 127) with E2M1's 1/2 folded in (llama.cpp's GGML_E8M0_TO_FP32_HALF,
// bit for bit; e = 0 and 1 give the fp32 subnormals 2^-128 and 2^-127).
//
// k8 is the K-quants' own two-level form: one int8 sub-scale sc per (row, group) and one fp16 super scale d per
// (row, super-block of 256 elements of K), scale = float(sc) * float(d). The product is exact in fp32 (11 + 7
// significant bits), so a k8 matrix gives bit for bit the outputs of the same values stored as fp32. A block's k8
// scales are its [n_groups][16 rows] sub-scale bytes, then [n_supers][16 rows] fp16 super scales (n_supers =
// ceil(kp / 256); the 16 of a super-block are one 32-byte vector load); the sub-scale is signed, so Q6_K's int8
// scales and Q3_K's sc - 32 are held as they are (1.125 bytes per group of 16, 1.25 per group of 32, against
// fp32's 4). Codes loaded with scales (and mins) given as fp32 are split into the two levels at packing, exactly or
// refused (pack.cpp split_k8); every group size divides 256.
//
// The scales, and for affine matrices after them the mins, are each one such "scale set" of the matrix's scale type:
// [n_groups][16] values (k8: and the super scales after them), mins stored as the scales are (fp32 mins for fp32
// scales, fp16 for fp16: Q4_1's d and m; k8's sub-mins and fp16 dmin: the K-quants'; one int8 zero point per value
// for the zero-point types). Per-row scales are fp32; affine scales are fp32, fp16, bf16, k8, k4 or a zero-point type
// (not e8m0, which has no negative or zero values). fp8 is symmetric
// only and takes fp32, fp16, bf16 or e8m0 scales (not k8 or k4).
//
// k4 is Q2_K's two-level form, affine only: per (row, group) one byte holding a 4-bit unsigned sub-scale sc (low
// nibble) and a 4-bit unsigned sub-min m (high nibble), per (row, super-block of 256) an fp16 super scale d and an
// fp16 super min dmin; scale = float(sc) * float(d), min = float(m) * float(dmin) (exact in fp32, as k8). Its scale
// set is the [n_groups][16 rows] pair bytes, then [n_supers][16] fp16 d; its min set (right after, as for every
// affine matrix) only the [n_supers][16] fp16 dmin: the sub-mins are the high nibbles of the scale set's bytes. 1 + 4
// / group bytes per group of 16 for scales and mins together: Q2_K's 84 bytes per 256 values, its 2-bit codes
// included. A kernel widens a group's 16 scales as k8's (one load of the bytes, a mask, two conversions and a
// multiply) and its mins the same with a shift for the mask. Values given as fp32 are split at packing exactly or
// refused (pack.cpp split_two_level); the sign of d carries a set's sign (all its values <= 0: d < 0).
//
// e4m3 and e4m3_div are NVFP4's scales at their file's bytes, lut4 only (symmetric, grouped): one E4M3 byte b per
// (row, group), the file's, and one fp32 factor per row block (the matrix's per-tensor scale f, the same in every block
// of the matrix) after the set's [n_groups][16] bytes, so a group of 16 e2m1 codes costs 9 bytes as in the file (and
// a row block 4 more). The value is the NVFP4 references' own fp32 product (ModelOpt: e4m3 x f) or quotient
// (compressed-tensors: e4m3 / f), halved for E2M1's doubled codebook:
//     e4m3:     scale = fl(e4m3(b) * f) / 2          e4m3_div: scale = fl(e4m3(b) / f) / 2
// The block stores the factor the kernels use, F = f * 2^7 (e4m3) or f * 2^-7 (e4m3_div), and every kernel widens a
// group's 16 bytes as fp8's codes: b to the IEEE half of e4m3(b) * 2^-8 with integer ops (its sign to bit 15, its
// other 7 bits to bits 7..13; subnormals included), vcvtph2ps to fp32 (exact), then one multiply by F (or one
// division) — fl(e4m3(b) 2^-8 * F) is fl(e4m3(b) * f) / 2 wherever the scale is normal, and the packer stores a
// scale only where the widened byte gives it bit for bit (e4m3_store). GGUF's NVFP4 (no per-tensor scale: ue4m3(b) /
// 2) is e4m3 with f = 1, also the factor of weights packed from floats. The NaN codes 0x7F, 0xFF are never stored.
//
// f32_zp, f16_zp and bf16_zp hold the int4 experts of GPTQ, AWQ and compressed-tensors checkpoints with zero points
// (asymmetric) at their file's bytes, affine only: w = s * (u - z) with u the 4-bit code (the affine nibble as it is),
// s the file's scale and z its 4-bit zero point, i.e. value = s * u - min with min = s * z. The scale set is the
// base type's ([n_groups][16] fp32, fp16 or bf16: the file's scale dtype), the min set one signed byte z per (row,
// group), [n_groups][16] int8, and every kernel widens a group's 16 mins as
//     min = fl(scale * float(z))         with scale the group's widened scale (the base type's widening)
// one exact conversion of the bytes and one multiply: exact for fp16 and bf16 scales (at most 11 + 7 significant
// bits), and for fp32 scales the one rounding of fl(s * z), the fp32 min a loader computes. So a matrix gives bit for
// bit the outputs of the same values held as fp32 scales and fp32 mins. A group costs the file's scale and one byte
// where the file has half a byte (fp16: 3 bytes per group, 1.0075x the file's int4 at group 128, 1.027x at 32). The
// packer stores a min only where some z in [-128, 127] gives it bit for bit (pack.cpp store_row_set); mins chosen
// from floats are rounded to the nearest multiple of the stored scale.
//
// Groups: 16, 32, 64 or 128 elements of K (16: GGUF's Q2_K, Q3_K and Q6_K, NVFP4), or per row (int8, int4 and fp8,
// symmetric: one scale per row, stored repeated in every group of 128, so every kernel reads it as a grouped
// matrix).
//
// Shared scales (fp8 only; MatrixFormat::shared_scales): one scale per (row block, group), the same for its 16
// rows, laid out [row block][group] — block FP8's 128 x 128 blocks, whose scale would otherwise be stored 16 times
// per group (4 bytes per 128 weights: 3.1% over the checkpoint's bytes; shared, 4 per 2048: 0.2%). A kernel
// broadcasts the one scale where it would load 16.
//
// Activations are quantized once per layer into "activation rows" (ActRow below) whose element type follows
// the weight format: fp32 for bf16 and fp8 weights (fp8: each quad of K as x0 x2 x1 x3), int16 for int8 weights,
// int8 for int4 and lut4 weights, each with one fp32 scale and one int32 element sum per group (the sum undoes the
// unsigned offset of the weights; fp32 rows leave both unused).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace hetmoe {

enum class WeightFormat : int {
  bf16 = 0,
  int8 = 1,
  int4 = 2,
  lut4 = 3,
  fp8 = 4,
  int6 = 5,
  int5 = 6,
  int3 = 7,
  int2 = 8,
  grid = 9
};
constexpr int kWeightFormats = 10;

// The bit-plane formats (see the top of this file).
constexpr inline bool plane_format(WeightFormat f) {
  return (int)f >= (int)WeightFormat::int6 && (int)f <= (int)WeightFormat::int2;
}

// Bits per code of an integer format (0 for bf16 and fp8).
constexpr inline int code_bits(WeightFormat f) {
  switch (f) {
    case WeightFormat::int8: return 8;
    case WeightFormat::int6: return 6;
    case WeightFormat::int5: return 5;
    case WeightFormat::int4:
    case WeightFormat::lut4: return 4;
    case WeightFormat::int3: return 3;
    case WeightFormat::int2: return 2;
    default: return 0;
  }
}

// Whether a format's row-block kernels read int16 activations (int8, int6, int5: codes of 5 bits and more) rather
// than int8 ones (int4, lut4, int3, int2). The AMX GEMM reads int8 activations for all of them.
constexpr inline bool wide_codes(WeightFormat f) {
  return f == WeightFormat::int8 || f == WeightFormat::int6 || f == WeightFormat::int5;
}

// A bit-plane format's unit (see the top of this file): low and high bits per code, quads of 16 of K, lines.
struct Planes {
  int lo_bits = 0, hi_bits = 0, quads = 0, lines = 0;
  constexpr int unit_k() const { return 16 * quads; }
  constexpr int lo_lines() const { return lo_bits == 4 ? 2 : 1; }  // low lines per quad
  // Unit-relative line of the low bits of byte line f of quad q, and their shift.
  constexpr int lo_line(int q, int f) const { return (q % quads) * lo_lines() + (lo_bits == 4 ? f / 2 : 0); }
  constexpr int lo_shift(int f) const { return lo_bits == 4 ? 4 * (f % 2) : 2 * f; }
  constexpr int hi_line() const { return lines - 1; }
  constexpr int hi_shift(int q, int f) const { return hi_bits == 2 ? 2 * f : 4 * (q % quads) + f; }
  constexpr size_t unit_offset(int q) const {
    return (size_t)(q / quads) * lines * 64;
  }  // of quad q's unit, in a block
};
constexpr inline Planes planes_of(WeightFormat f) {
  switch (f) {
    case WeightFormat::int6: return {4, 2, 1, 3};
    case WeightFormat::int5: return {4, 1, 2, 5};
    case WeightFormat::int3: return {2, 1, 2, 3};
    case WeightFormat::int2: return {2, 0, 1, 1};
    default: return {};
  }
}

// The stored code u of row r, element k of a bit-plane block, and its store (the other bits kept).
inline int plane_code(const Planes& p, const uint8_t* block, int r, int k) {
  const int q = k / 16, f = (k / 4) % 4, e = k % 4;
  const uint8_t* u = block + p.unit_offset(q) + 4 * r + e;
  int code = (u[p.lo_line(q, f) * 64] >> p.lo_shift(f)) & ((1 << p.lo_bits) - 1);
  if (p.hi_bits) code |= ((u[p.hi_line() * 64] >> p.hi_shift(q, f)) & ((1 << p.hi_bits) - 1)) << p.lo_bits;
  return code;
}
inline void set_plane_code(const Planes& p, uint8_t* block, int r, int k, int code) {
  const int q = k / 16, f = (k / 4) % 4, e = k % 4;
  uint8_t* u = block + p.unit_offset(q) + 4 * r + e;
  uint8_t* lo = u + p.lo_line(q, f) * 64;
  const int lm = ((1 << p.lo_bits) - 1) << p.lo_shift(f);
  *lo = (uint8_t)((*lo & ~lm) | ((code << p.lo_shift(f)) & lm));
  if (p.hi_bits) {
    uint8_t* hi = u + p.hi_line() * 64;
    const int hm = ((1 << p.hi_bits) - 1) << p.hi_shift(q, f);
    *hi = (uint8_t)((*hi & ~hm) | (((code >> p.lo_bits) << p.hi_shift(q, f)) & hm));
  }
}

// Formats whose row-block kernels read fp32 activations (and whose AMX GEMM reads bf16 ones).
inline bool float_activations(WeightFormat f) { return f == WeightFormat::bf16 || f == WeightFormat::fp8; }

// One E4M3 code as the fp32 it stands for, exactly (the NaN codes 0x7F / 0xFF: NaN).
inline float e4m3_to_float(uint8_t c) {
  if ((c & 0x7f) == 0x7f) return NAN;
  const int e = (c >> 3) & 15, m = c & 7;  // subnormal (e = 0): m * 2^-9, else (8 + m) * 2^(e - 10)
  const float v = std::ldexp((float)(e ? 8 + m : m), (e ? e : 1) - 10);
  return c & 0x80 ? -v : v;
}

// Where element k of an fp8 weight's K sits in its fp32 activation row: each quad of K stored x0 x2 x1 x3 (see the
// top of this file).
inline int fp8_act_index(int k) { return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1); }

// How int8/int4/lut4 codes become values (see the top of this file). bf16 ignores it.
enum class Scaling : int { symmetric = 0, affine = 1 };

// How a matrix's scales are stored (see the top of this file).
enum class ScaleType : int {
  f32 = 0,
  f16 = 1,
  bf16 = 2,
  e8m0 = 3,
  k8 = 4,
  k4 = 5,
  e4m3 = 6,
  e4m3_div = 7,
  f32_zp = 8,
  f16_zp = 9,
  bf16_zp = 10
};
constexpr int kScaleTypes = 11;
constexpr int kSuperBlock = 256;  // k8, k4: elements of K per fp16 super scale
// Scale types of two levels: a sub-scale per group times an fp16 super scale per kSuperBlock of K.
constexpr inline bool two_level(ScaleType t) { return t == ScaleType::k8 || t == ScaleType::k4; }
// Scale types of one byte per group and one fp32 factor per row block (e4m3, e4m3_div: see the top of this file).
constexpr inline bool factor_scales(ScaleType t) { return t == ScaleType::e4m3 || t == ScaleType::e4m3_div; }
constexpr int kFactorBytes = 4;  // the fp32 factor after a factor_scales set's bytes
// Scale types whose affine mins are zero points (f32_zp, f16_zp, bf16_zp: see the top of this file): the scale set
// is of the base type, the min set one int8 z per (row, group), min = fl(scale * z).
constexpr inline bool zero_points(ScaleType t) {
  return t == ScaleType::f32_zp || t == ScaleType::f16_zp || t == ScaleType::bf16_zp;
}
// The type a zero-point type's scales are stored in (every other type: itself).
constexpr inline ScaleType zp_base(ScaleType t) {
  return t == ScaleType::f32_zp    ? ScaleType::f32
         : t == ScaleType::f16_zp  ? ScaleType::f16
         : t == ScaleType::bf16_zp ? ScaleType::bf16
                                   : t;
}

// The IEEE half bits of e4m3(b) * 2^-8 (exact, subnormals included; the NaN codes give 1.875 * 2^(7 - 8)).
constexpr inline uint16_t e4m3_half_bits(uint8_t b) { return (uint16_t)((b & 0x80) << 8 | (b & 0x7f) << 7); }
// The factor F a block of a factor_scales type stores for the per-tensor scale f (see the top of this file).
inline float stored_factor(ScaleType t, float f) { return t == ScaleType::e4m3_div ? f * 0x1p-7f : f * 0x1p7f; }

// The 16 values a lut4 nibble indexes (see the top of this file), or a grid matrix's grid type (the GGUF i-quant
// whose blocks it holds); none for every other format.
enum class Codebook : int {
  none = 0,
  e2m1 = 1,
  iq4nl = 2,
  iq2_xxs = 3,
  iq2_xs = 4,
  iq2_s = 5,
  iq3_xxs = 6,
  iq3_s = 7,
  iq1_s = 8,
  iq1_m = 9
};
constexpr int kCodebooks = 10;
constexpr int kLut4Codebooks = 3;  // none, e2m1, iq4nl: the ones with 16 values
constexpr inline bool grid_codebook(Codebook c) { return (int)c >= (int)Codebook::iq2_xxs; }

// What a grid type's rows hold per super-block of 256 values of K (see the top of this file): its scale group (16
// or 32), the bytes of one row's block as the row block stores them (the file's block less its fp16 d, IQ1_M's
// whole), and whether its fp16 d is held apart, in the scale set.
struct GridInfo {
  int group = 0, row_bytes = 0;
  bool has_d = false;
};
constexpr inline GridInfo grid_info(Codebook c) {
  switch (c) {
    case Codebook::iq2_xxs: return {32, 64, true};  // IQ2_XXS: 66 B
    case Codebook::iq2_xs: return {16, 72, true};   // IQ2_XS: 74 B
    case Codebook::iq2_s: return {16, 80, true};    // IQ2_S: 82 B
    case Codebook::iq3_xxs: return {32, 96, true};  // IQ3_XXS: 98 B
    case Codebook::iq3_s: return {32, 108, true};   // IQ3_S: 110 B
    case Codebook::iq1_s: return {32, 48, true};    // IQ1_S: 50 B
    case Codebook::iq1_m: return {16, 56, false};   // IQ1_M: 56 B, its d spread over its scales
    default: return {};
  }
}
// Bytes of one block of a grid type in the file (per row and super-block of 256).
constexpr inline int grid_file_bytes(Codebook c) { return grid_info(c).row_bytes + (grid_info(c).has_d ? 2 : 0); }
// clang-format off
inline constexpr int8_t kCodebookValues[kLut4Codebooks][16] = {
    /* none  */ {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    /* e2m1  */ {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},  // E2M1 x 2: sign bit 3, |v| in bits 0-2
    /* iq4nl */ {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
};
// clang-format on
inline const int8_t* codebook_values(Codebook c) { return kCodebookValues[grid_codebook(c) ? 0 : (int)c]; }

// Bumped whenever the packed bytes of any format change: converted-expert caches of another version are rebuilt.
// (Scale types, lut4, k8, narrow affine mins, fp8 and the bit-plane formats added formats; fp32-scaled int8/int4 kept
// their bytes. 2: Q2_K's experts, which a cache keys by the plan's format alone, moved from k8 to k4 scales. 3: int4
// experts with zero points (GPTQ, AWQ, compressed-tensors) moved from fp32 scales and mins to the zero-point types.)
constexpr int kLayoutVersion = 3;

constexpr int kRowsPerBlock = 16;
constexpr int kLineBytes = 64;
constexpr int kBf16Group = 32;  // K padding unit for bf16, which has no scales

static_assert(kRowsPerBlock * 4 == kLineBytes, "a line is 16 rows x 4 bytes");

inline int k_per_line(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return 2;
    case WeightFormat::int8: return 4;
    case WeightFormat::int4: return 8;
    case WeightFormat::lut4: return 8;
    case WeightFormat::fp8: return 4;
    default: return 0;  // bit-plane formats: lines per unit of K instead (planes_of); grid: bytes per row (grid_info)
  }
}

inline int scale_width(ScaleType t) {  // bytes per stored scale
  switch (t) {
    case ScaleType::f32: return 4;
    case ScaleType::f16: return 2;
    case ScaleType::bf16: return 2;
    case ScaleType::e8m0: return 1;
    case ScaleType::k8: return 1;  // the sub-scale (the super scales come after a set's sub-scales)
    case ScaleType::k4: return 1;  // the (sub-scale, sub-min) byte
    case ScaleType::e4m3:
    case ScaleType::e4m3_div: return 1;  // the E4M3 byte (the block's factor comes after a set's bytes)
    case ScaleType::f32_zp: return 4;    // the scale (the min set holds a byte per (row, group): min_width)
    case ScaleType::f16_zp:
    case ScaleType::bf16_zp: return 2;
  }
  return 0;
}
// Bytes per stored value of an affine min set: the zero-point types' int8 z, every other type as its scales.
inline int min_width(ScaleType t) { return zero_points(t) ? 1 : scale_width(t); }

// One stored scale as the fp32 it stands for (exact). The kernels widen 16 at a time with vector instructions that
// give these bits; this is the portable definition. k8: the sub-scale alone, k4: the sub-scale nibble alone
// (RowBlock::value multiplies in the super scale and reads k4's sub-min), e4m3 / e4m3_div: the byte's scale at the
// factor f = 1, e4m3(b) / 2 (RowBlock::value applies the block's factor: factor_scale).
inline float scale_to_float(ScaleType t, const uint8_t* p);
// The scale of E4M3 byte b in a block of factor_scales type t whose stored factor is F: fl(half(b) * F), e4m3_div
// fl(half(b) / F) (see the top of this file); the kernels' widening gives these bits.
inline float factor_scale(ScaleType t, uint8_t b, float factor) {
  const uint16_t h = e4m3_half_bits(b);
  const uint8_t hb[2] = {(uint8_t)(h & 0xff), (uint8_t)(h >> 8)};
  const float v = scale_to_float(ScaleType::f16, hb);
  return t == ScaleType::e4m3_div ? v / factor : v * factor;
}
inline float scale_to_float(ScaleType t, const uint8_t* p) {
  if (factor_scales(t)) return factor_scale(t, p[0], stored_factor(t, 1.f));
  t = zp_base(t);  // zero-point types: the scale of the base type
  uint32_t bits = 0;
  switch (t) {
    case ScaleType::f32: std::memcpy(&bits, p, 4); break;
    case ScaleType::bf16: bits = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16; break;
    case ScaleType::e8m0: bits = p[0] < 2 ? 0x00200000u << p[0] : (uint32_t)(p[0] - 1) << 23; break;
    case ScaleType::k8:
    case ScaleType::k4: {
      const float f = t == ScaleType::k8 ? (float)(int8_t)p[0] : (float)(p[0] & 15);
      std::memcpy(&bits, &f, 4);
      break;
    }
    case ScaleType::e4m3:
    case ScaleType::e4m3_div:
    case ScaleType::f32_zp:
    case ScaleType::f16_zp:
    case ScaleType::bf16_zp: break;  // above
    case ScaleType::f16: {
      const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
      const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
      if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
      } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
      } else {  // zero or subnormal: mant * 2^-24, exact in fp32
        const float f = (float)mant * 5.9604644775390625e-8f;
        std::memcpy(&bits, &f, 4);
        bits |= sign;
      }
      break;
    }
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// What a matrix's bytes hold besides its shape: the element format and, for int8/int4/lut4, its scale group, how
// codes become values, how scales are stored and (lut4) the codebook or (grid) the grid type. dispatch.h
// check_kernel_choice says which combinations the kernels run.
struct MatrixFormat {
  WeightFormat format = WeightFormat::bf16;
  int group = 128;  // int8/int4: <= 0 means per-row scales
  Scaling scaling = Scaling::symmetric;
  ScaleType scale_type = ScaleType::f32;
  Codebook codebook = Codebook::none;
  bool shared_scales = false;  // fp8: one scale per (row block, group) for its 16 rows (see the top of this file)
};

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
  ScaleType scale_type = ScaleType::f32;
  Codebook codebook = Codebook::none;
  bool shared_scales = false;  // fp8: one scale per (row block, group)

  // group <= 0 with int8, int4 or fp8 means per-row scales (symmetric only).
  static MatrixShape make(WeightFormat f, int n, int k, int group, Scaling scaling = Scaling::symmetric) {
    MatrixShape s;
    s.per_row = f != WeightFormat::bf16 && group <= 0;
    if (s.per_row) group = 128;
    s.scaling = f == WeightFormat::bf16 ? Scaling::symmetric : scaling;
    s.format = f;
    s.n = n;
    s.k = k;
    s.group = f == WeightFormat::bf16 ? kBf16Group : group;
    s.kp = (int)round_up(k, f == WeightFormat::grid ? kSuperBlock : s.group);  // grid: whole super-blocks
    s.n_blocks = (int)((n + kRowsPerBlock - 1) / kRowsPerBlock);
    return s;
  }
  static MatrixShape make(const MatrixFormat& m, int n, int k) {
    MatrixShape s = make(m.format, n, k, m.group, m.scaling);
    if (s.has_scales()) s.scale_type = m.scale_type;
    s.codebook = m.format == WeightFormat::lut4 || m.format == WeightFormat::grid ? m.codebook : Codebook::none;
    s.shared_scales = m.format == WeightFormat::fp8 && m.shared_scales && !s.per_row;
    return s;
  }
  MatrixFormat matrix_format() const {
    return {format, per_row ? 0 : group, scaling, scale_type, codebook, shared_scales};
  }
  int scale_rows() const { return shared_scales ? 1 : kRowsPerBlock; }  // stored scales per group of a block
  int n_groups() const { return kp / group; }
  int lines_per_block() const {
    if (format == WeightFormat::grid) return n_supers() * kRowsPerBlock * grid_info(codebook).row_bytes / kLineBytes;
    if (!plane_format(format)) return kp / k_per_line(format);
    const Planes p = planes_of(format);
    return (kp + p.unit_k() - 1) / p.unit_k() * p.lines;
  }
  size_t block_bytes() const { return (size_t)lines_per_block() * kLineBytes; }
  size_t data_bytes() const { return block_bytes() * n_blocks; }
  bool has_scales() const { return format != WeightFormat::bf16; }
  bool affine() const { return scaling == Scaling::affine; }
  int n_supers() const { return (int)((kp + kSuperBlock - 1) / kSuperBlock); }  // k8/k4 super-blocks of a row
  // bytes of one block's scale set: n_groups x 16 (shared: x 1) of scale_type (k8, k4: then n_supers x 16 fp16 super
  // scales; e4m3, e4m3_div: then the fp32 factor)
  size_t set_bytes() const {
    if (!has_scales()) return 0;
    if (format == WeightFormat::grid)  // the fp16 d of each (super-block, row)
      return grid_info(codebook).has_d ? (size_t)n_supers() * kRowsPerBlock * 2 : 0;
    return (size_t)n_groups() * scale_rows() * scale_width(scale_type) +
           (two_level(scale_type) ? (size_t)n_supers() * kRowsPerBlock * 2 : 0) +
           (factor_scales(scale_type) ? kFactorBytes : 0);
  }
  // bytes of one block's min set (affine): as the scale set, but k4's is its fp16 super mins alone and a zero-point
  // type's its n_groups x 16 int8 zero points
  size_t min_set_bytes() const {
    if (!affine()) return 0;
    if (zero_points(scale_type)) return (size_t)n_groups() * kRowsPerBlock;
    return scale_type == ScaleType::k4 ? (size_t)n_supers() * kRowsPerBlock * 2 : set_bytes();
  }
  // bytes of one block's scales: the scale set, and (affine) the min set after it
  size_t block_scale_bytes() const { return set_bytes() + min_set_bytes(); }
  size_t scale_bytes() const { return block_scale_bytes() * n_blocks; }
};

// What the micro-kernel reads for one row block.
struct RowBlock {
  const uint8_t* data;    // block_bytes(), 64-byte aligned
  const uint8_t* scales;  // the scale set ([n_groups][16] of scale_type; k8/k4: then the super scales), or nullptr
  int kp;
  int group;
  const uint8_t* mins = nullptr;  // affine: the min set (same layout, right after the scales); symmetric: nullptr
  ScaleType scale_type = ScaleType::f32;
  const int8_t* codebook = nullptr;  // lut4: its 16 values
  bool shared_scales = false;        // fp8: scales [n_groups], one per group for all 16 rows
  Codebook grid = Codebook::none;    // grid: the grid type
  float factor = 0.f;                // e4m3, e4m3_div: the block's stored factor F (see the top of this file)

  // The block of shape s whose data and scales (s.block_scale_bytes()) start at these addresses.
  static RowBlock at(const MatrixShape& s, const uint8_t* data, const uint8_t* scales) {
    RowBlock b;
    b.data = data;
    b.scales = s.has_scales() ? scales : nullptr;
    b.kp = s.kp;
    b.group = s.group;
    b.scale_type = s.scale_type;
    b.mins = s.affine() ? scales + s.set_bytes() : nullptr;
    b.codebook = s.format == WeightFormat::lut4 ? codebook_values(s.codebook) : nullptr;
    b.shared_scales = s.shared_scales;
    b.grid = s.format == WeightFormat::grid ? s.codebook : Codebook::none;
    if (factor_scales(b.scale_type)) std::memcpy(&b.factor, scales + (size_t)s.n_groups() * kRowsPerBlock, 4);
    return b;
  }
  int n_groups() const { return kp / group; }
  int scale_rows() const { return shared_scales ? 1 : kRowsPerBlock; }  // stored values per group of a set
  // The 16 stored values of group g of a set (scales or mins; k8: the sub-scales; k4: the pair bytes, in the scale
  // set for the mins too; shared: the one), and of a k8/k4 set the 16 fp16 super scales of g's super-block.
  const uint8_t* group_of(const uint8_t* set, int g) const {
    if (zero_points(scale_type) && set == mins) return set + (size_t)g * kRowsPerBlock;  // the 16 zero points
    if (scale_type == ScaleType::k4) set = scales;
    return set + (size_t)g * scale_rows() * scale_width(scale_type);
  }
  const uint8_t* super_of(const uint8_t* set, int g) const {
    const size_t subs = scale_type == ScaleType::k4 && set == mins ? 0 : (size_t)n_groups() * kRowsPerBlock;
    return set + subs + (size_t)(g * group / kSuperBlock) * kRowsPerBlock * 2;
  }
  // k4: the shift of a set's nibble in the pair bytes (scales 0, mins 4); 0 for every other type
  int sub_shift(const uint8_t* set) const { return scale_type == ScaleType::k4 && set == mins ? 4 : 0; }
  const uint8_t* group_scales(int g) const { return group_of(scales, g); }
  // Value r of group g of a set widened to fp32 (exact; k8/k4: sub-scale times super scale, one exact product).
  float value(const uint8_t* set, int g, int r) const {
    if (zero_points(scale_type)) {  // the scale, or fl(scale * z)
      const float sc = scale_to_float(scale_type, group_of(scales, g) + r * scale_width(scale_type));
      return set == mins ? sc * (float)(int8_t)group_of(mins, g)[r] : sc;
    }
    const uint8_t* p = group_of(set, g) + (shared_scales ? 0 : r) * scale_width(scale_type);
    if (factor_scales(scale_type)) return factor_scale(scale_type, *p, factor);
    const uint8_t nib = (uint8_t)(*p >> sub_shift(set));
    const float v = scale_to_float(scale_type, scale_type == ScaleType::k4 ? &nib : p);
    return two_level(scale_type) ? v * scale_to_float(ScaleType::f16, super_of(set, g) + 2 * r) : v;
  }
  float scale(int g, int r) const { return value(scales, g, r); }
  float min(int g, int r) const { return value(mins, g, r); }
  // The 16 values of group g of a set as fp32: in place for fp32 sets (not shared; f32_zp: its scales), else widened
  // into buf.
  const float* widened(const uint8_t* set, int g, float* buf) const {
    if ((scale_type == ScaleType::f32 || (scale_type == ScaleType::f32_zp && set == scales)) && !shared_scales)
      return reinterpret_cast<const float*>(group_of(set, g));
    for (int r = 0; r < kRowsPerBlock; ++r) buf[r] = value(set, g, r);
    return buf;
  }
};

// Activation row for one token: [kp] elements, then per group one fp32 scale and one int32 sum.
// bf16 weights: fp32 elements, scales = 1, sums = 0 (unused). Rows are padded to 64 bytes.
inline size_t act_elem_bytes(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return 4;
    case WeightFormat::int8: return 2;
    case WeightFormat::int4: return 1;
    case WeightFormat::lut4: return 1;
    case WeightFormat::fp8: return 4;
    default: return wide_codes(f) ? 2 : 1;  // bit-plane formats
  }
}

// AMX tiles multiply bf16 x bf16 and int8 x int8 only, so experts computed with AMX read narrower activations:
// bf16 for bf16 and fp8 weights, int8 (groups as above, qmax 127) for int8, int4 and lut4 weights. `group` > 0
// overrides the matrix's group for per-row int8/int4 weights, whose AMX GEMM sums a whole activation group in the tiles
// before its one fp32 epilogue (kernels/amx/gemm.h): x gets one group over the whole row (one scale per token), h
// groups of amx_row_group(I) (the NUMA split cuts I at multiples of it, so slices round h as the unsplit engine does).
// Same row layout otherwise; the GEMM reads these rows from an AmxPanel (below), which stores them as its A tiles.
inline size_t act_elem_bytes_amx(WeightFormat f) { return float_activations(f) ? 2 : 1; }

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
