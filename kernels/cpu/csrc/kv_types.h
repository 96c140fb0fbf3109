// The KV pool's element types (--kv-cache-dtype) and their portable conversions: the attention
// kernels are written once over an element type E and convert each key and value row as they
// load it, so a 16-bit pool is read at half the bytes of an fp32 one and an int8 pool at a quarter.
//
// A pool row is one (KV head, slot)'s head_dim elements. fp32, fp16 and bf16 rows are those
// elements; an int8 row is head_dim codes followed by its fp32 scale (4 bytes, in memory order):
// value_i = scale * code_i, symmetric, scale = max|x| / 127 over the row. A scale per row, not
// per page: a page is written over many steps (decode appends a token at a time), and a page-wide
// scale would have to re-quantize the page's earlier tokens whenever a later one is larger. It
// costs 4 bytes a row (6% at head_dim 64). Keeping it in the row keeps one tensor per pool and
// layer whatever the type, so every reader of the pool's bytes (the KV tier, the gathers of the
// torch backends) moves scales with their codes.
//
// Writing rounds to nearest even; fp16 saturates at +-65504 (an inf would turn a score or a value
// into NaN). Reading is exact (every element is an fp32 value). The int8 scale is applied per row,
// not per element: a key's score is its dot product with the codes times its scale, a value's
// weight in the softmax sum is multiplied by its scale.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixlm {

enum class KVType : int64_t { f32 = 0, f16 = 1, bf16 = 2, i8 = 3 };

float half_to_float(uint16_t h);  // common.h's, exact

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

constexpr float kHalfMax = 65504.0f;

// fp32 -> fp16, saturated at +-65504, rounded to nearest even (subnormals included): F16C's
// _mm256_cvtps_ph bit for bit on the saturated value, and torch's .half().
inline uint16_t float_to_half(float f) {
  f = f < -kHalfMax ? -kHalfMax : f > kHalfMax ? kHalfMax : f;  // NaN passes through
  const uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000, a = x & 0x7FFFFFFF;
  if (a > 0x7F800000) return uint16_t(sign | 0x7E00);  // NaN
  if (a >= 0x38800000) {                               // a normal half (2^-14 and up): rebias by 112
    uint32_t r = a - 0x38000000;
    r += 0xFFF + ((r >> 13) & 1);  // the 13 dropped bits, to nearest even (a carry bumps the exponent)
    return uint16_t(sign | (r >> 13));
  }
  if (a < 0x33000000) return uint16_t(sign);  // at most 2^-25, half the least subnormal: ties to 0
  // a subnormal half: the value in units of 2^-24, m 2^(e - 126) for the 24-bit significand m
  const uint32_t e = a >> 23, m = (a & 0x7FFFFF) | 0x800000, shift = 126 - e;
  uint32_t q = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1))) ++q;
  return uint16_t(sign | q);
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

// fp32 -> bf16 rounded to nearest even (a NaN stays one: 0x7FC0, torch's)
inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
  return uint16_t((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

// Element types: T the stored element; load(p, i) element i of a row as fp32; `scaled`: the row
// carries its int8 scale after its head_dim codes.
struct F32 {
  using T = float;
  static constexpr bool scaled = false;
  static float load(const T* p, int64_t i) { return p[i]; }
};
struct F16 {
  using T = uint16_t;
  static constexpr bool scaled = false;
  static float load(const T* p, int64_t i) { return half_to_float(p[i]); }
};
struct BF16 {
  using T = uint16_t;
  static constexpr bool scaled = false;
  static float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
};
struct I8 {
  using T = int8_t;
  static constexpr bool scaled = true;
  static float load(const T* p, int64_t i) { return float(p[i]); }
};

// Elements of the stored type from one row to the next: head_dim, and for int8 its scale's 4 bytes.
inline int64_t kv_row(KVType t, int64_t head_dim) { return t == KVType::i8 ? head_dim + 4 : head_dim; }

// One KV head's rows of a layer's keys or values, typed: row `slot` at at(slot).
template <class E>
struct KVRows {
  const typename E::T* base;
  int64_t row, head_dim;
  const typename E::T* at(int64_t slot) const { return base + slot * row; }
  // the row's int8 scale (1 for the other types: never read)
  float scale(int64_t slot) const {
    if constexpr (E::scaled) {
      float s;
      std::memcpy(&s, at(slot) + head_dim, 4);
      return s;
    } else {
      return 1.0f;
    }
  }
  // What a key's dot product with the query (over its stored elements) is multiplied by for its
  // score: the attention scale, and an int8 row's own scale first (one multiply either way).
  float key_factor(int64_t slot, float attention_scale) const {
    if constexpr (E::scaled) return scale(slot) * attention_scale;
    return attention_scale;
  }
  // A value's weight p (its exp'd score) as it multiplies the stored elements.
  float value_weight(int64_t slot, float p) const {
    if constexpr (E::scaled) return p * scale(slot);
    return p;
  }
};

// Write x [head_dim] into row `out` of type E, rounded to nearest even (an int8 row: its codes
// round(x_i * 127 / max|x|) and scale max|x| / 127, as torch computes them; a row whose 127 /
// max|x| is no finite float, max|x| 0 or below ~4e-37, is zeros: codes 0, scale 0).
template <class E>
inline void store_row(const float* x, int64_t head_dim, typename E::T* out) {
  if constexpr (E::scaled) {
    float amax = 0.0f;
    for (int64_t i = 0; i < head_dim; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    const bool finite = 127.0f / amax <= FLT_MAX;
    const float scale = finite ? amax / 127.0f : 0.0f, inv = finite ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < head_dim; ++i) out[i] = int8_t(std::nearbyint(x[i] * inv));
    std::memcpy(out + head_dim, &scale, 4);
  } else {
    for (int64_t i = 0; i < head_dim; ++i) {
      if constexpr (std::is_same_v<E, F16>) out[i] = float_to_half(x[i]);
      else if constexpr (std::is_same_v<E, BF16>) out[i] = float_to_bf16(x[i]);
      else out[i] = x[i];
    }
  }
}

}  // namespace radixlm
