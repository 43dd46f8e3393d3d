#include "formats/pack.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "formats/activation.h"
#include "formats/grid.h"

namespace hetmoe {

namespace {

// Byte offset, inside a row block, of element (row r, column k), and for int4 which nibble holds it.
inline size_t elem_offset(WeightFormat f, int r, int k, int* nibble) {
  int kpl = k_per_line(f);
  int line = k / kpl, j = k % kpl;
  size_t base = (size_t)line * kLineBytes + (size_t)r * 4;
  switch (f) {
    case WeightFormat::bf16: *nibble = 0; return base + (size_t)j * 2;
    case WeightFormat::int8:
    case WeightFormat::fp8: *nibble = 0; return base + j;
    case WeightFormat::int4:
    case WeightFormat::lut4: *nibble = j / 4; return base + (j % 4);
    default: *nibble = 0; return 0;  // bit-plane formats: plane_code (layout.h)
  }
}

inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Round half to even for |v| < 2^22 with plain float adds (vectorizes, unlike nearbyint on baseline x86-64).
inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

constexpr int kMaxGroup = 128;

// Squared error of quantizing w[0..n) (n a multiple of 8, zero-padded) to int4 with scale s.
inline float int4_error(const float* w, int n, float s) {
  const float inv = 1.f / s;
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lanes so the compiler can vectorize the reduction
  for (int i = 0; i < n; i += 8)
    for (int l = 0; l < 8; ++l) {
      float d = w[i + l] - clampf(round_even(w[i + l] * inv), -8.f, 7.f) * s;
      part[l] += d * d;
    }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Chooses the int4 scale of one group (values src[0..n)) and its codes in [-8, 7]: the best of a few scales
// between amax/7 and amax/11 by squared error, then a least-squares refit kept if it lowers the error.
float choose_int4_scale(const float* src, int n, int8_t* q) {
  float w[kMaxGroup];
  int n8 = (n + 7) / 8 * 8;
  float amax = 0.f;
  for (int i = 0; i < n8; ++i) {
    w[i] = i < n ? src[i] : 0.f;
    amax = std::fmax(amax, std::fabs(w[i]));
  }
  if (amax == 0.f) {
    std::memset(q, 0, n);
    return 0.f;
  }
  float best_err = INFINITY, best_s = amax / 7.f;
  for (int c = 0; c < 9; ++c) {
    float s = amax / (7.f + 0.5f * c), err = int4_error(w, n8, s);
    if (err < best_err) best_err = err, best_s = s;
  }
  float inv = 1.f / best_s, wq = 0.f, qq = 0.f;
  for (int i = 0; i < n; ++i) {
    q[i] = (int8_t)clampf(round_even(w[i] * inv), -8.f, 7.f);
    wq += w[i] * q[i];
    qq += (float)(q[i] * q[i]);
  }
  if (qq > 0.f && wq > 0.f) {
    float s2 = wq / qq, err2 = 0.f;
    for (int i = 0; i < n; ++i) {
      float d = w[i] - q[i] * s2;
      err2 += d * d;
    }
    if (err2 < best_err) best_s = s2;
  }
  return best_s;
}

// The int4 scale of a whole row (per-row scales), chosen as choose_int4_scale chooses a group's, over any length:
// the best of the same candidate scales by squared error, then the least-squares refit for the codes of the best.
// Returns the stored scale; *code_scale is the one the codes are rounded with (the best candidate).
float choose_int4_row_scale(const float* src, int n, float* code_scale) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(src[i]));
  *code_scale = 0.f;
  if (amax == 0.f) return 0.f;
  const int n8 = n / 8 * 8;
  float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // the last n % 8 values, zero-padded (zeros add no error)
  std::memcpy(tail, src + n8, sizeof(float) * (n - n8));
  auto error = [&](float s) { return int4_error(src, n8, s) + (n8 < n ? int4_error(tail, 8, s) : 0.f); };
  float best_err = INFINITY, best_s = amax / 7.f;
  for (int c = 0; c < 9; ++c) {
    float s = amax / (7.f + 0.5f * c), err = error(s);
    if (err < best_err) best_err = err, best_s = s;
  }
  *code_scale = best_s;
  const float inv = 1.f / best_s;
  double wq = 0., qq = 0.;  // a row holds thousands of values: double sums
  for (int i = 0; i < n; ++i) {
    const float q = clampf(round_even(src[i] * inv), -8.f, 7.f);
    wq += (double)src[i] * q;
    qq += (double)q * q;
  }
  if (qq > 0. && wq > 0.) {
    const float s2 = (float)(wq / qq);
    double err2 = 0.;
    for (int i = 0; i < n; ++i) {
      const float d = src[i] - clampf(round_even(src[i] * inv), -8.f, 7.f) * s2;
      err2 += (double)d * d;
    }
    if (err2 < best_err) return s2;
  }
  return best_s;
}

// fp32 -> IEEE half bits, rounded to nearest even (overflow to infinity, underflow through the subnormals to 0).
uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   // NaN
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds past 65504: infinity
  if (ax < 0x38800000u) {  // below 2^-14: a multiple of 2^-24, rounded to nearest even
    float a;
    std::memcpy(&a, &ax, 4);
    return (uint16_t)(sign | (uint32_t)round_even(a * 16777216.f));
  }
  const uint32_t r = ax + 0x0fffu + ((ax >> 13) & 1u) - (112u << 23);
  return (uint16_t)(sign | (r >> 13));
}

// fp32 -> the nearest E4M3 code, rounded to nearest even, |v| clamped to 448 (the largest finite E4M3); v finite.
uint8_t float_to_e4m3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fmin(std::fabs(v), 448.f);
  if (a < 0x1p-6f) return sign | (uint8_t)round_even(a * 512.f);  // subnormals: m * 2^-9 (m = 8 is 2^-6, code 8)
  int e;
  const float m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): exponent field e + 6, mantissa (2m - 1) * 8
  const int code = ((e + 6) << 3) + (int)round_even((2.f * m - 1.f) * 8.f);  // a carry into the exponent is right
  return sign | (uint8_t)std::min(code, 0x7e);
}

// The scales of the E4M3 bytes 0 .. 0x7E (every non-negative code but NaN) in a block of factor_scales type t whose
// stored factor is F > 0: non-decreasing in the byte, so a scale's byte is found by bisection (the negative codes
// 0x80 | b give the same values negated, exactly).
struct E4m3Scales {
  float v[0x7f];
  E4m3Scales(ScaleType t, float factor) {
    for (int b = 0; b < 0x7f; ++b) v[b] = factor_scale(t, (uint8_t)b, factor);
  }
  // The byte of scale x: exact, the byte whose scale is x bit for bit (false where none is: x not finite, or not a
  // value of this factor); else the smallest at or above |x| (0x7E at most), with x's sign. *out: the byte's scale.
  bool store(float x, bool exact, uint8_t* dst, float* out) const {
    if (!std::isfinite(x)) return false;
    const float a = std::fabs(x);
    const int b = std::min((int)(std::lower_bound(v, v + 0x7f, a) - v), 0x7e);
    const uint8_t code = (uint8_t)(b | (std::signbit(x) ? 0x80 : 0));
    const float got = std::signbit(x) ? -v[b] : v[b];
    if (exact && std::memcmp(&got, &x, 4) != 0) return false;
    *dst = code;
    if (out) *out = got;
    return true;
  }
};
inline const E4m3Scales& unit_e4m3_scales(ScaleType t) {  // at the factor f = 1
  static const E4m3Scales mul(ScaleType::e4m3, stored_factor(ScaleType::e4m3, 1.f));
  static const E4m3Scales div(ScaleType::e4m3_div, stored_factor(ScaleType::e4m3_div, 1.f));
  return t == ScaleType::e4m3_div ? div : mul;
}

// The stored bytes of scale v in type t, exactly: false when v has no exact form in t (or is not finite). The
// rounded encoding of a value t holds exactly is that value itself, so exact = rounded and read back unchanged.
bool store_scale_exact(ScaleType t, float v, uint8_t* dst) {
  if (!std::isfinite(v)) return false;
  uint8_t buf[4] = {0, 0, 0, 0};
  const float back = store_scale_rounded(t, v, buf);
  if (std::memcmp(&back, &v, 4) != 0) return false;
  std::memcpy(dst, buf, scale_width(t));
  return true;
}

}  // namespace

float store_scale_rounded(ScaleType t, float v, uint8_t* dst) {
  if (zero_points(t)) return store_scale_rounded(zp_base(t), v, dst);  // the scale set is the base type's
  uint8_t buf[4];
  switch (t) {
    case ScaleType::f32: std::memcpy(buf, &v, 4); break;
    case ScaleType::f16: {
      const uint16_t h = float_to_half(v);
      std::memcpy(buf, &h, 2);
      break;
    }
    case ScaleType::bf16: {
      const uint16_t b = float_to_bf16(v);
      std::memcpy(buf, &b, 2);
      break;
    }
    case ScaleType::e4m3:
    case ScaleType::e4m3_div: {  // at the factor f = 1 (the factor of weights packed from floats): up, as e8m0
      float got = 0.f;
      if (!unit_e4m3_scales(t).store(std::isfinite(v) ? v : 0.f, false, buf, &got)) buf[0] = 0;
      break;
    }
    case ScaleType::f32_zp:
    case ScaleType::f16_zp:
    case ScaleType::bf16_zp: break;  // above
    case ScaleType::e8m0: {
      int e2 = -127;  // 0 -> the smallest, 2^-128
      if (v > 0.f) {
        const float m = std::frexp(v, &e2);  // v = m 2^e2, m in [0.5, 1)
        if (m == 0.5f) --e2;                 // a power of two stays itself: 2^(e2 - 1)
      }
      buf[0] = (uint8_t)std::min(255, std::max(0, e2 + 128));
      break;
    }
  }
  std::memcpy(dst, buf, scale_width(t));
  return scale_to_float(t, buf);
}

namespace {

// |v| = m * 2^e with m an odd integer (v finite, not 0).
inline void odd_form(float v, uint32_t* m, int* e) {
  int ex;
  const float f = std::frexp(std::fabs(v), &ex);  // [0.5, 1): 24 bits of mantissa at most
  uint32_t mm = (uint32_t)std::ldexp(f, 24);
  ex -= 24;
  while (!(mm & 1u)) mm >>= 1, ++ex;
  *m = mm;
  *e = ex;
}

inline uint32_t gcd(uint32_t a, uint32_t b) {
  while (b) {
    const uint32_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// The sub-scale range of a two-level scale type (layout.h): k8 int8 [-128, 127] (a set's values of both signs), k4
// 4-bit [0, 15] (one sign per set: the super scale's).
struct SubRange {
  int lo, hi;
};
inline SubRange sub_range(ScaleType t) { return t == ScaleType::k4 ? SubRange{0, 15} : SubRange{-128, 127}; }

// k8 / k4 (layout.h): the n values v of one row's super-block as sub-scales times one fp16 super scale, exactly.
// With g the gcd of the values' odd parts and 2^e the smallest of their powers of two, d = g 2^e gives every
// sub-scale its least magnitude; d / r (r = 2, 3, ... whose odd part divides g) is tried when d itself is not an
// fp16 value. A negative d takes the sign when the sub-scales would otherwise leave their range (k8: Q6_K's -128
// with d < 0; k4: a set whose values are all <= 0). False when no split exists (or a value is not finite).
bool split_two_level(ScaleType t, const float* v, int n, int8_t* sub, uint16_t* d_bits) {
  const SubRange range = sub_range(t);
  uint32_t g = 0;
  int emin = 1 << 30;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return false;
    if (v[i] == 0.f) continue;
    uint32_t m;
    int e;
    odd_form(v[i], &m, &e);
    g = gcd(g, m);
    emin = std::min(emin, e);
  }
  if (g == 0) {  // all zero
    std::memset(sub, 0, n);
    *d_bits = 0;
    return true;
  }
  const int limit = std::max(range.hi, -range.lo);
  for (int r = 1; r <= limit; ++r) {
    int tt = r, s2 = 0;
    while (!(tt & 1)) tt >>= 1, ++s2;
    if (g % (uint32_t)tt) continue;
    const float d = std::ldexp((float)(g / (uint32_t)tt), emin - s2);
    uint8_t h[2];
    if (!store_scale_exact(ScaleType::f16, d, h)) continue;
    int lo = 0, hi = 0, c[kSuperBlock / 16];
    bool fits = true;
    for (int i = 0; i < n && fits; ++i) {
      const double q = (double)v[i] / d;  // an integer (d divides v exactly)
      fits = std::fabs(q) <= (double)limit;
      c[i] = fits ? (int)q : 0;
      lo = std::min(lo, c[i]), hi = std::max(hi, c[i]);
    }
    if (!fits) return false;  // a smaller d only makes sub-scales larger
    const bool plus = lo >= range.lo && hi <= range.hi, minus = -hi >= range.lo && -lo <= range.hi;
    if (!plus && !minus) return false;
    const int sign = plus ? 1 : -1;
    for (int i = 0; i < n; ++i) sub[i] = (int8_t)(sign * c[i]);
    uint16_t bits;
    std::memcpy(&bits, h, 2);
    *d_bits = sign < 0 ? (uint16_t)(bits ^ 0x8000u) : bits;
    return true;
  }
  return false;
}

// k8 / k4 from values chosen here (packing floats): d = the fp16 at or above max |v| / (the largest sub-scale), sub
// = round(v / d) (k4: the values are >= 0, affine scales and mins); the values d * sub are written back into v.
void round_two_level(ScaleType t, float* v, int n, int8_t* sub, uint16_t* d_bits) {
  const SubRange range = sub_range(t);
  const float top = (float)range.hi;
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  uint8_t h[2];
  float d = store_scale_rounded(ScaleType::f16, amax / top, h);
  if (d * top < amax) {  // rounded down: the next fp16 up
    uint16_t b;
    std::memcpy(&b, h, 2);
    ++b;
    std::memcpy(h, &b, 2);
    d = scale_to_float(ScaleType::f16, h);
  }
  std::memcpy(d_bits, h, 2);
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < n; ++i) {
    sub[i] = (int8_t)clampf(round_even(v[i] * inv), (float)std::max(range.lo, -range.hi), top);
    v[i] = (float)sub[i] * d;
  }
}

// The zero point z in [-128, 127] of min m against the stored scale sc: the one whose fl(sc * z) is m bit for bit
// (false where none is, or m is not finite). m = fl(sc * z) lies within half an ulp of sc * z, so z is the integer
// nearest m / sc; its neighbours are tried for the signed zeros (sc = 0: z = 0 gives +-0, z = -1 the other sign).
bool zero_point_of(float sc, float m, int8_t* z) {
  if (!std::isfinite(m) || !std::isfinite(sc)) return false;
  const double c = sc != 0.f ? std::nearbyint((double)m / (double)sc) : 0.0;
  for (const double d : {0.0, -1.0, 1.0}) {
    const double zz = c + d;
    if (zz < -128.0 || zz > 127.0) continue;
    const float got = sc * (float)zz;
    if (std::memcmp(&got, &m, 4) == 0) {
      *z = (int8_t)zz;
      return true;
    }
  }
  return false;
}

}  // namespace

void set_block_factor(const MatrixShape& s, uint8_t* scales, float f) {
  if (!factor_scales(s.scale_type)) return;
  const float stored = stored_factor(s.scale_type, f);
  std::memcpy(scales + (size_t)s.n_groups() * kRowsPerBlock, &stored, 4);
}

bool store_row_set(const MatrixShape& s, float* v, int r, uint8_t* scales, bool mins, bool exact) {
  const int ng = s.n_groups();
  const ScaleType t = s.scale_type;
  uint8_t* set = scales + (mins ? s.set_bytes() : 0);
  if (zero_points(t) && mins) {  // one int8 z per group against the row's stored scale: min = fl(scale * z)
    const int width = scale_width(t);
    for (int g = 0; g < ng; ++g) {
      const float sc = scale_to_float(t, scales + ((size_t)g * kRowsPerBlock + r) * width);
      int8_t z;
      if (exact && !zero_point_of(sc, v[g], &z)) return false;
      if (!exact) {
        const double c = sc != 0.f && std::isfinite(v[g]) ? std::nearbyint((double)v[g] / (double)sc) : 0.0;
        z = (int8_t)(c < -128.0 ? -128.0 : c > 127.0 ? 127.0 : c);
        v[g] = sc * (float)z;
      }
      set[(size_t)g * kRowsPerBlock + r] = (uint8_t)z;
    }
    return true;
  }
  if (factor_scales(t)) {  // symmetric only: the scale set, at the block's factor
    float factor;
    std::memcpy(&factor, scales + (size_t)ng * kRowsPerBlock, 4);
    if (!(factor > 0.f) || !std::isfinite(factor)) return false;
    const E4m3Scales table(t, factor);
    for (int g = 0; g < ng; ++g)
      if (!table.store(v[g], exact, set + (size_t)g * kRowsPerBlock + r, &v[g])) return false;
    return true;
  }
  if (!two_level(t)) {
    const int width = scale_width(t);
    for (int g = 0; g < ng; ++g) {
      uint8_t* dst = set + ((size_t)g * s.scale_rows() + (s.shared_scales ? 0 : r)) * width;
      if (exact && !store_scale_exact(t, v[g], dst)) return false;
      if (!exact) v[g] = store_scale_rounded(t, v[g], dst);
    }
    return true;
  }
  // k8: [ng][16] sub-scales, then [n_supers][16] fp16 super scales, per set; k4: the pair bytes (scales' nibble low,
  // mins' high) and the fp16 d of the scale set, the min set only its fp16 dmin (layout.h)
  const bool k4 = t == ScaleType::k4;
  uint8_t* subs = k4 ? scales : set;
  uint8_t* supers = k4 && mins ? set : set + (size_t)ng * kRowsPerBlock;
  const int shift = k4 && mins ? 4 : 0;
  const int per = kSuperBlock / s.group;  // groups per super-block (every group size divides 256)
  for (int g0 = 0; g0 < ng; g0 += per) {
    const int n = std::min(per, ng - g0);
    int8_t sub[kSuperBlock / 16];
    uint16_t d;
    if (exact && !split_two_level(t, v + g0, n, sub, &d)) return false;
    if (!exact) round_two_level(t, v + g0, n, sub, &d);
    for (int i = 0; i < n; ++i) {
      uint8_t& b = subs[(size_t)(g0 + i) * kRowsPerBlock + r];
      b = k4 ? (uint8_t)((b & ~(15 << shift)) | ((uint8_t)sub[i] << shift)) : (uint8_t)sub[i];
    }
    std::memcpy(supers + ((size_t)(g0 / per) * kRowsPerBlock + r) * 2, &d, 2);
  }
  return true;
}

namespace {

// The index of the codebook value nearest v (the lower index on a tie).
inline int nearest_index(const int8_t* cb, float v) {
  int best = 0;
  float best_d = INFINITY;
  for (int i = 0; i < 16; ++i) {
    const float d = std::fabs(v - (float)cb[i]);
    if (d < best_d) best_d = d, best = i;
  }
  return best;
}

// Writes the codes of elements [k0, k0 + n) of one row (stored as code + offset: int8 symmetric 128, int4
// symmetric 8, affine and lut4 0) into its lines; dst points at the row's 4 bytes of line 0.
inline void put_codes(WeightFormat f, uint8_t* dst, int k0, int n, const int8_t* codes, int offset) {
  const Planes planes = planes_of(f);
  for (int i = 0; i < n; ++i) {
    int k = k0 + i;
    if (planes.lines) {  // dst is the block's start moved by 4 r: row 0 of that base is row r
      set_plane_code(planes, dst, 0, k, codes[i] + offset);
    } else if (f == WeightFormat::int8) {
      dst[(size_t)(k / 4) * kLineBytes + k % 4] = (uint8_t)(codes[i] + offset);
    } else {
      int j = k % 8;
      uint8_t* p = dst + (size_t)(k / 8) * kLineBytes + j % 4;
      uint8_t u = (uint8_t)(codes[i] + offset);
      *p = j >= 4 ? (uint8_t)((*p & 0x0f) | (u << 4)) : (uint8_t)((*p & 0xf0) | u);
    }
  }
}

// The stored offset of a symmetric code (layout.h); affine codes and lut4 indices are stored as they are.
inline int code_offset(const MatrixShape& s) {
  if (s.affine() || s.format == WeightFormat::lut4) return 0;
  return 1 << (code_bits(s.format) - 1);  // int8 128, int6 32, int5 16, int4 8, int3 4, int2 2
}

// The code range of a shape's integer format: symmetric q (the stored code is q + code_offset), affine u.
inline int code_min(const MatrixShape& s) {
  if (s.affine() || s.format == WeightFormat::lut4) return 0;
  return s.format == WeightFormat::int8 ? -127 : -(1 << (code_bits(s.format) - 1));
}
inline int code_max(const MatrixShape& s) {
  if (s.format == WeightFormat::int8) return 127;
  if (s.affine() || s.format == WeightFormat::lut4) return (1 << code_bits(s.format)) - 1;
  return (1 << (code_bits(s.format) - 1)) - 1;
}

// One row of a bit-plane block from its stored codes u[0 .. whole units of K) (layout.h), into bytes that are zero.
inline void write_plane_row(const Planes& p, uint8_t* block, int r, const uint8_t* u, int n_quads) {
  const int lo_mask = (1 << p.lo_bits) - 1, hi_mask = (1 << p.hi_bits) - 1;
  for (int q = 0; q < n_quads; ++q) {
    uint8_t* unit = block + p.unit_offset(q) + 4 * r;
    for (int f = 0; f < 4; ++f) {
      uint8_t* lo = unit + p.lo_line(q, f) * kLineBytes;
      uint8_t* hi = unit + p.hi_line() * kLineBytes;
      for (int e = 0; e < 4; ++e) {
        const int c = u[16 * q + 4 * f + e];
        lo[e] |= (uint8_t)((c & lo_mask) << p.lo_shift(f));
        if (p.hi_bits) hi[e] |= (uint8_t)(((c >> p.lo_bits) & hi_mask) << p.hi_shift(q, f));
      }
    }
  }
}
inline int plane_quads(const MatrixShape& s) {  // quads of K a bit-plane block stores (whole units)
  const Planes p = planes_of(s.format);
  return s.lines_per_block() / p.lines * p.quads;
}

inline void clear_block(const MatrixShape& s, uint8_t* data, uint8_t* scales) {
  const WeightFormat f = s.format;
  const uint8_t zero = s.affine() ? 0 : f == WeightFormat::int8 ? 128 : (f == WeightFormat::int4 ? 0x88 : 0);
  std::memset(data, plane_format(f) ? 0 : zero, s.block_bytes());
  if (plane_format(f) && !s.affine()) {  // every code the offset 2^(b-1): the top bit of each code's high part
    const Planes p = planes_of(f);
    const uint8_t top = p.hi_bits == 1 ? 0xff : 0xaa;  // 1-bit fields all set; 2-bit fields 0b10
    for (int line = p.hi_line(); line < s.lines_per_block(); line += p.lines)
      std::memset(data + (size_t)line * kLineBytes, top, kLineBytes);
  }
  // bytes 0: the scale 0, or in e8m0 the smallest, 2^-128 (padded rows' outputs are never read); e4m3: factor 1
  if (s.has_scales()) std::memset(scales, 0, s.block_scale_bytes());
  if (s.has_scales()) set_block_factor(s, scales, 1.f);
}

// fp8 from floats, row r of block rb (dst: its 4 bytes of line 0): per (row, group) — or per (block, group) with
// shared scales, then over the block's 16 rows — the scale that maps the largest |w| to 448 (rounded to the scale
// type: e8m0 up to a power of two, so no code clips), each w / scale rounded to the nearest E4M3 code.
void pack_fp8_row(const MatrixShape& s, const float* w, int rb, int r, uint8_t* dst, uint8_t* scales) {
  const int row = rb * kRowsPerBlock + r, ng = s.n_groups(), width = scale_width(s.scale_type);
  const int rows = std::min(kRowsPerBlock, s.n - rb * kRowsPerBlock);
  const float* src = w + (size_t)row * s.k;
  float row_amax = 0.f;
  if (s.per_row)
    for (int k = 0; k < s.k; ++k) row_amax = std::fmax(row_amax, std::fabs(src[k]));
  for (int g = 0; g < ng; ++g) {
    const int k0 = g * s.group, n = std::min(s.group, s.k - k0);
    if (n <= 0) break;
    float amax = row_amax;
    const int r0 = s.shared_scales ? 0 : r, r1 = s.shared_scales ? rows : r + 1;
    for (int rr = r0; rr < r1 && !s.per_row; ++rr)
      for (int i = 0; i < n; ++i)
        amax = std::fmax(amax, std::fabs(w[(size_t)(rb * kRowsPerBlock + rr) * s.k + k0 + i]));
    uint8_t* sp = scales + ((size_t)g * s.scale_rows() + (s.shared_scales ? 0 : r)) * width;
    const float scale = store_scale_rounded(s.scale_type, amax / 448.f, sp);
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int i = 0; i < n; ++i) {
      const int k = k0 + i;
      dst[(size_t)(k / 4) * kLineBytes + k % 4] = float_to_e4m3(src[k] * inv);
    }
  }
}

}  // namespace

bool pack_row_block_fp8(const MatrixShape& s, const uint8_t* codes, const float* group_scales, int rb, uint8_t* data,
                        uint8_t* scales) {
  if (s.format != WeightFormat::fp8 || s.per_row) return false;
  clear_block(s, data, scales);
  const int ng = s.n_groups(), row0 = rb * kRowsPerBlock, rows = std::min(kRowsPerBlock, s.n - row0);
  const int width = scale_width(s.scale_type);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* src = codes + (size_t)(row0 + r) * s.k;
    int nan = 0;
    for (int k = 0; k < s.k; ++k) nan |= (src[k] & 0x7f) == 0x7f;
    if (nan) return false;
  }
  // whole lines: each row's 4 codes are its 4 bytes of the line, as stored
  const int n_lines = s.k / 4;
  for (int j = 0; j < n_lines; ++j) {
    uint8_t* line = data + (size_t)j * kLineBytes;
    for (int r = 0; r < rows; ++r) std::memcpy(line + 4 * r, codes + (size_t)(row0 + r) * s.k + 4 * j, 4);
  }
  for (int r = 0; r < rows; ++r) {
    const uint8_t* src = codes + (size_t)(row0 + r) * s.k;
    for (int k = n_lines * 4; k < s.k; ++k) data[(size_t)(k / 4) * kLineBytes + 4 * r + k % 4] = src[k];
    for (int g = 0; g < ng; ++g) {
      const float sc = group_scales[(size_t)(row0 + r) * ng + g];
      if (s.shared_scales && r > 0) {  // one scale for the block's rows: theirs must all be the same
        if (std::memcmp(&sc, &group_scales[(size_t)row0 * ng + g], 4) != 0) return false;
        continue;
      }
      if (!store_scale_exact(s.scale_type, sc,
                             scales + ((size_t)g * s.scale_rows() + (s.shared_scales ? 0 : r)) * width))
        return false;
    }
  }
  return true;
}

bool pack_row_block_codes(const MatrixShape& s, const int8_t* q, const float* group_scales, const float* group_mins,
                          int rb, uint8_t* data, uint8_t* scales, float factor) {
  const WeightFormat f = s.format;
  if (f == WeightFormat::bf16 || s.per_row || (s.affine() && !group_mins)) return false;
  if (s.affine() && (s.scale_type == ScaleType::e8m0 || factor_scales(s.scale_type))) return false;
  clear_block(s, data, scales);
  set_block_factor(s, scales, factor);
  const int off = code_offset(s);
  const int lo = code_min(s), hi = code_max(s);
  const int ng = s.n_groups(), row0 = rb * kRowsPerBlock, rows = std::min(kRowsPerBlock, s.n - row0);
  for (int r = 0; r < rows; ++r) {
    const int8_t* src = q + (size_t)(row0 + r) * s.k;
    int bad = 0;
    for (int k = 0; k < s.k; ++k) bad |= (src[k] < lo) | (src[k] > hi);
    if (bad) return false;
  }
  // Whole lines first, each line's 16 rows in turn (sequential stores), 4 codes (int8) or 8 (int4, lut4) per 32-bit
  // word: q + offset is q ^ 0x80 for int8 codes in [-127, 127] and (q & 15) ^ 8 for int4 codes in [-8, 7].
  if (plane_format(f)) {  // codes + offset, padding the offset (affine: 0), into zeroed planes, row by row
    const Planes p = planes_of(f);
    const int n_quads = plane_quads(s);
    std::vector<uint8_t> u((size_t)n_quads * 16);
    std::memset(data, 0, s.block_bytes());
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const int8_t* src = r < rows ? q + (size_t)(row0 + r) * s.k : nullptr;
      for (int k = 0; k < n_quads * 16; ++k) u[k] = (uint8_t)((src && k < s.k ? src[k] : 0) + off);
      write_plane_row(p, data, r, u.data(), n_quads);
    }
  }
  const int kpl = plane_format(f) ? 0 : f == WeightFormat::int8 ? 4 : 8, n_lines = kpl ? s.k / kpl : 0;
  const uint32_t flip = off == 128 ? 0x80808080u : off == 8 ? 0x08080808u : 0u;
  for (int j = 0; j < n_lines; ++j) {
    uint8_t* line = data + (size_t)j * kLineBytes;
    for (int r = 0; r < rows; ++r) {
      const int8_t* src = q + (size_t)(row0 + r) * s.k + (size_t)j * kpl;
      uint32_t w, hi4;
      std::memcpy(&w, src, 4);
      if (f == WeightFormat::int8) {
        w ^= flip;
      } else {  // byte b: k = 8j + b in the low nibble, 8j + 4 + b in the high one
        std::memcpy(&hi4, src + 4, 4);
        w = ((w & 0x0f0f0f0fu) ^ flip) | (((hi4 & 0x0f0f0f0fu) ^ flip) << 4);
      }
      std::memcpy(line + 4 * r, &w, 4);
    }
  }
  std::vector<float> row_values(ng);  // one row's scales (or mins), which store_row_set may rewrite
  for (int r = 0; r < rows; ++r) {
    const int row = row0 + r;
    const int8_t* src = q + (size_t)row * s.k;
    if (!plane_format(f)) put_codes(f, data + 4 * r, n_lines * kpl, s.k - n_lines * kpl, src + n_lines * kpl, off);
    std::memcpy(row_values.data(), group_scales + (size_t)row * ng, sizeof(float) * ng);
    if (!store_row_set(s, row_values.data(), r, scales, false, true)) return false;
    if (s.affine()) {
      std::memcpy(row_values.data(), group_mins + (size_t)row * ng, sizeof(float) * ng);
      if (!store_row_set(s, row_values.data(), r, scales, true, true)) return false;
    }
  }
  return true;
}

namespace {

// pack_row_block for the scale sets a row must choose whole before its codes: k8 (a super scale per 256 elements)
// and affine scales narrower than fp32 (scale and min rounded together). Each group's scale (and min) as the fp32
// path chooses it, the row's sets rounded to the type (store_row_set), then the codes for the stored values.
void pack_row_block_rounded(const MatrixShape& s, const float* w, int rb, uint8_t* data, uint8_t* scales) {
  const WeightFormat f = s.format;
  const int ng = s.n_groups();
  const int8_t* cb = f == WeightFormat::lut4 ? codebook_values(s.codebook) : nullptr;
  int cb_max = 0;
  for (int i = 0; cb && i < 16; ++i) cb_max = std::max(cb_max, std::abs((int)cb[i]));
  const float qmax = (float)code_max(s);  // affine codes 0..qmax
  const MatrixShape sym = MatrixShape::make(f, s.n, s.k, s.group);
  const float qlo = (float)code_min(sym), qhi = (float)code_max(sym);
  std::vector<float> sc(ng), mn(ng);
  int8_t codes[kMaxGroup];
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const int row = rb * kRowsPerBlock + r;
    if (row >= s.n) break;
    const float* src = w + (size_t)row * s.k;
    for (int g = 0; g < ng; ++g) {
      const int k0 = g * s.group, n = std::max(0, std::min(s.group, s.k - k0));
      float lo = 0.f, hi = 0.f, amax = 0.f;
      for (int i = 0; i < n; ++i) {
        lo = std::fmin(lo, src[k0 + i]), hi = std::fmax(hi, src[k0 + i]);
        amax = std::fmax(amax, std::fabs(src[k0 + i]));
      }
      if (s.affine()) {
        sc[g] = (hi - lo) / qmax;
        mn[g] = -lo;
      } else if (cb) {
        sc[g] = amax / (float)cb_max;
      } else if (f != WeightFormat::int4) {  // int8 and the bit-plane formats: absmax
        sc[g] = amax / qhi;
      } else {
        sc[g] = n > 0 ? choose_int4_scale(src + k0, n, codes) : 0.f;
      }
    }
    store_row_set(s, sc.data(), r, scales, false, false);
    if (s.affine()) store_row_set(s, mn.data(), r, scales, true, false);
    for (int g = 0; g < ng; ++g) {
      const int k0 = g * s.group, n = std::min(s.group, s.k - k0);
      if (n <= 0) break;
      const float inv = sc[g] > 0.f ? 1.f / sc[g] : 0.f;
      for (int i = 0; i < n; ++i) {
        const float v = src[k0 + i];
        if (s.affine())
          codes[i] = (int8_t)clampf(round_even((v + mn[g]) * inv), 0.f, qmax);
        else if (cb)
          codes[i] = (int8_t)nearest_index(cb, v * inv);
        else
          codes[i] = (int8_t)clampf(round_even(v * inv), qlo, qhi);
      }
      put_codes(f, data + 4 * r, k0, n, codes, code_offset(s));
    }
  }
}

}  // namespace

void pack_row_block(const MatrixShape& s, const float* w, int rb, uint8_t* data, uint8_t* scales) {
  const WeightFormat f = s.format;
  if (f == WeightFormat::grid)
    throw std::invalid_argument("grid weights hold a GGUF file's i-quant blocks as they are (load_codes); floats are "
                                "not quantized into them");
  clear_block(s, data, scales);
  if (two_level(s.scale_type) || (s.affine() && s.scale_type != ScaleType::f32))
    return pack_row_block_rounded(s, w, rb, data, scales);
  const int ng = s.n_groups(), width = scale_width(s.scale_type);
  float* mins = reinterpret_cast<float*>(scales + (size_t)ng * kRowsPerBlock * width);  // affine only (fp32)
  const int8_t* cb = f == WeightFormat::lut4 ? codebook_values(s.codebook) : nullptr;
  int cb_max = 0;
  for (int i = 0; cb && i < 16; ++i) cb_max = std::max(cb_max, std::abs((int)cb[i]));
  int8_t codes[kMaxGroup];
  for (int r = 0; r < kRowsPerBlock; ++r) {
    int row = rb * kRowsPerBlock + r;
    if (row >= s.n) break;
    const float* src = w + (size_t)row * s.k;
    uint8_t* dst = data + 4 * r;  // this row's 4 bytes of line 0
    if (f == WeightFormat::bf16) {
      for (int k = 0; k < s.k; ++k) {
        uint16_t v = float_to_bf16(src[k]);
        std::memcpy(dst + (size_t)(k / 2) * kLineBytes + 2 * (k % 2), &v, 2);
      }
      continue;
    }
    if (f == WeightFormat::fp8) {
      pack_fp8_row(s, w, rb, r, dst, scales);
      continue;
    }
    float row_amax = 0.f, row_scale = 0.f, row_inv = 0.f;
    if (s.per_row && f == WeightFormat::int8)
      for (int k = 0; k < s.k; ++k) row_amax = std::fmax(row_amax, std::fabs(src[k]));
    if (s.per_row && f == WeightFormat::int4) {
      float code_scale;
      row_scale = choose_int4_row_scale(src, s.k, &code_scale);
      row_inv = code_scale > 0.f ? 1.f / code_scale : 0.f;
    }
    for (int g = 0; g < ng; ++g) {
      int k0 = g * s.group, n = std::min(s.group, s.k - k0);
      if (n <= 0) break;
      uint8_t* sp = scales + ((size_t)g * kRowsPerBlock + r) * width;  // this (row, group)'s scale
      float scale;
      if (s.affine()) {  // min/max over the group (with 0), codes 0..qmax
        float lo = 0.f, hi = 0.f;
        for (int i = 0; i < n; ++i) lo = std::fmin(lo, src[k0 + i]), hi = std::fmax(hi, src[k0 + i]);
        const float qmax = (float)code_max(s);
        scale = (hi - lo) / qmax;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        for (int i = 0; i < n; ++i) codes[i] = (int8_t)clampf(round_even((src[k0 + i] - lo) * inv), 0.f, qmax);
        mins[(size_t)g * kRowsPerBlock + r] = -lo;
      } else if (cb) {  // lut4: the scale that maps the group's largest |w| to the codebook's, the nearest entries
        float amax = 0.f;
        for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(src[k0 + i]));
        scale = store_scale_rounded(s.scale_type, amax / (float)cb_max, sp);
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        for (int i = 0; i < n; ++i) codes[i] = (int8_t)nearest_index(cb, src[k0 + i] * inv);
      } else if (f != WeightFormat::int4) {  // int8 and the bit-plane formats: absmax to the largest positive code
        float amax = row_amax;
        if (!s.per_row)
          for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(src[k0 + i]));
        const float qhi = (float)code_max(s), qlo = (float)code_min(s);
        float inv = amax > 0.f ? qhi / amax : 0.f;
        for (int i = 0; i < n; ++i) codes[i] = (int8_t)clampf(round_even(src[k0 + i] * inv), qlo, qhi);
        scale = amax / qhi;
      } else if (s.per_row) {  // int4, the row's one scale
        for (int i = 0; i < n; ++i) codes[i] = (int8_t)clampf(round_even(src[k0 + i] * row_inv), -8.f, 7.f);
        scale = row_scale;
      } else {
        scale = choose_int4_scale(src + k0, n, codes);
      }
      if (!cb && s.scale_type != ScaleType::f32) {  // int8/int4: the codes again, for the scale the type holds
        scale = store_scale_rounded(s.scale_type, scale, sp);
        const float inv = scale > 0.f ? 1.f / scale : 0.f, qlo = (float)code_min(s);
        const float qhi = (float)code_max(s);
        for (int i = 0; i < n; ++i) codes[i] = (int8_t)clampf(round_even(src[k0 + i] * inv), qlo, qhi);
      } else if (!cb) {
        std::memcpy(sp, &scale, 4);
      }
      put_codes(f, dst, k0, n, codes, code_offset(s));
    }
  }
}

bool pack_row_block_grid(const MatrixShape& s, const uint8_t* raw, int rb, uint8_t* data, uint8_t* scales) {
  const GridInfo gi = grid_info(s.codebook);
  const int n_supers = s.n_supers(), file_bytes = grid_file_bytes(s.codebook);
  std::memset(data, 0, s.block_bytes());
  if (s.has_scales()) std::memset(scales, 0, s.block_scale_bytes());
  bool ok = true;
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const int row = rb * kRowsPerBlock + r;
    if (row >= s.n) break;
    for (int sp = 0; sp < n_supers; ++sp) {
      const uint8_t* src = raw + ((size_t)row * n_supers + sp) * file_bytes;
      uint16_t dbits;
      if (gi.has_d) {
        std::memcpy(scales + ((size_t)sp * kRowsPerBlock + r) * 2, src, 2);
        dbits = (uint16_t)(src[0] | src[1] << 8);
        src += 2;
      } else {
        dbits = grid::iq1m_d_bits(src);
      }
      ok &= (dbits & 0x7c00) != 0x7c00;  // a finite d
      std::memcpy(data + ((size_t)sp * kRowsPerBlock + r) * gi.row_bytes, src, gi.row_bytes);
    }
  }
  return ok;
}

void unpack_row_block(const MatrixShape& s, const uint8_t* data, const uint8_t* scales, int rb, float* w) {
  const WeightFormat f = s.format;
  const RowBlock b = RowBlock::at(s, data, scales);
  if (f == WeightFormat::grid) {  // scale * q, exact (formats/grid.h)
    alignas(64) uint8_t lines[kSuperBlock / 4 * kLineBytes];
    float sc[kSuperBlock / 16 * kRowsPerBlock];
    for (int sp = 0; sp < s.n_supers(); ++sp) {
      grid::decode_super(b, sp, lines, sc);
      for (int r = 0; r < kRowsPerBlock; ++r) {
        const int row = rb * kRowsPerBlock + r;
        if (row >= s.n) break;
        for (int k = 0; k < kSuperBlock && sp * kSuperBlock + k < s.k; ++k)
          w[(size_t)row * s.k + sp * kSuperBlock + k] =
              sc[k / s.group * kRowsPerBlock + r] * (float)(int8_t)lines[(k / 4) * kLineBytes + 4 * r + k % 4];
      }
    }
    return;
  }
  const int8_t* cb = f == WeightFormat::lut4 ? codebook_values(s.codebook) : nullptr;
  for (int r = 0; r < kRowsPerBlock; ++r) {
    int row = rb * kRowsPerBlock + r;
    if (row >= s.n) break;
    float* dst = w + (size_t)row * s.k;
    for (int k = 0; k < s.k; ++k) {
      int nib = 0;
      const uint8_t* p = plane_format(f) ? data : data + elem_offset(f, r, k, &nib);
      if (f == WeightFormat::bf16) {
        uint16_t v;
        std::memcpy(&v, p, 2);
        dst[k] = bf16_to_float(v);
      } else if (f == WeightFormat::fp8) {
        dst[k] = e4m3_to_float(*p) * b.scale(k / s.group, r);
      } else {
        const int g = k / s.group;
        const float scale = b.scale(g, r);
        const int u = plane_format(f)           ? plane_code(planes_of(f), data, r, k)
                      : f == WeightFormat::int8 ? (int)*p
                                                : (int)((*p >> (4 * nib)) & 0x0f);
        if (s.affine())  // two roundings, as gguf's dequantization: fl(fl(scale * u) - min)
          dst[k] = (float)u * scale - b.min(g, r);
        else if (cb)
          dst[k] = (float)cb[u] * scale;
        else
          dst[k] = (float)(u - code_offset(s)) * scale;
      }
    }
  }
}

}  // namespace hetmoe
