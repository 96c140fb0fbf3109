// Helpers shared by the AVX2 files: the target attribute every AVX2 function carries (the library
// is built for generic x86-64; ops.cpp calls these only where cpuid found AVX2, FMA and F16C),
// the horizontal sum whose order the portable paths copy, and exp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "kv_types.h"

#define RADIXLM_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace radixlm {

// (0+4, 1+5, 2+6, 3+7), then pairs, then the two
RADIXLM_AVX2 inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// exp(x) for x in float range: 2^k * p(r), x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial
// (Taylor coefficients; relative error below 2e-7 on that interval).
RADIXLM_AVX2 inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - k ln2 in two steps (ln2 split into a part exact in float and the rest)
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// 8 consecutive elements of a KV row of type E (kv_types.h) as fp32: exact, as E::load each.
template <class E>
RADIXLM_AVX2 inline __m256 load8(const typename E::T* p) {
  if constexpr (std::is_same_v<E, F16>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (std::is_same_v<E, BF16>) {  // the 16 bits are an fp32's high half
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (std::is_same_v<E, I8>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {
    return _mm256_loadu_ps(p);
  }
}

// Rows slots[0..n) of a head's keys (d a multiple of 8) into kt transposed as fp32,
// kt[c * stride + j] = key j's dimension c (an int8 key's times its scale): 8 keys x 8 dimensions
// a register transpose at a time (a third of the instructions of copying them one float at a
// time), the last n % 8 keys one by one. The blocked attention kernel's packing (extend_tile.h).
template <class E>
RADIXLM_AVX2 inline void pack_transposed(const KVRows<E>& keys, const int64_t* slots, int64_t n, int64_t d,
                                         int64_t stride, float* kt) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const typename E::T* row[8];
    __m256 scale[8];
    for (int u = 0; u < 8; ++u) {
      row[u] = keys.at(slots[j + u]);
      scale[u] = _mm256_set1_ps(keys.scale(slots[j + u]));
    }
    for (int64_t c = 0; c < d; c += 8) {
      __m256 a[8], t[8], v[8];
      for (int u = 0; u < 8; ++u) {
        a[u] = load8<E>(row[u] + c);
        if constexpr (E::scaled) a[u] = _mm256_mul_ps(a[u], scale[u]);
      }
      for (int u = 0; u < 8; u += 2) {  // pairs of rows interleaved
        t[u] = _mm256_unpacklo_ps(a[u], a[u + 1]);
        t[u + 1] = _mm256_unpackhi_ps(a[u], a[u + 1]);
      }
      for (int h = 0; h < 8; h += 4) {  // four rows' dimensions k (low half) and k + 4 (high half)
        v[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        v[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
        v[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        v[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
      }
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(kt + (c + k) * stride + j, _mm256_permute2f128_ps(v[k], v[k + 4], 0x20));
        _mm256_storeu_ps(kt + (c + k + 4) * stride + j, _mm256_permute2f128_ps(v[k], v[k + 4], 0x31));
      }
    }
  }
  for (; j < n; ++j) {
    const typename E::T* key = keys.at(slots[j]);
    const float scale = keys.scale(slots[j]);
    for (int64_t c = 0; c < d; ++c) kt[c * stride + j] = E::scaled ? E::load(key, c) * scale : E::load(key, c);
  }
}

}  // namespace radixlm
