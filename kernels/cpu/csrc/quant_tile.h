// The floating-point half of a tile's matmul, shared by the AVX2 and AVX-512 paths so both are
// the same operations in the same order (each bitwise the portable path): a block's integer dots
// scaled into each activation row's accumulator, and a row group's outputs stored. AVX2 code: an
// AVX-512 function, whose target includes AVX2, inlines it.
#pragma once

#include <algorithm>

#include "avx2.h"
#include "common.h"

namespace radixlm {

RADIXLM_AVX2 inline __m256 load8(const uint8_t* p, bool half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
              : _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// Block b of tile t: acc[i] += float(dots[i][h]) * (scale_h * d) for each half h in order, and
// zacc[i] += zero * sum, for activation rows m0 .. m0 + M.
template <int Halves, int M>
RADIXLM_AVX2 inline void scale_block(const QuantizedActivations& x, const TiledMatrix& w, const uint8_t* t, int64_t m0,
                                     int64_t b, const __m256i (&dots)[M][Halves], __m256 (&acc)[M], __m256 (&zacc)[M]) {
  const int64_t nb = w.blocks();
  __m256 scales[Halves];
  for (int h = 0; h < Halves; ++h) scales[h] = load8(t + h * kTileRows * (w.half ? 2 : 4), w.half);
  const __m256 zeros = w.zero ? load8(t + w.scale_bytes(), w.half) : _mm256_setzero_ps();
  for (int i = 0; i < M; ++i) {
    const __m256 d = _mm256_set1_ps(x.d[(m0 + i) * nb + b]);
    for (int h = 0; h < Halves; ++h)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i][h]), _mm256_mul_ps(scales[h], d), acc[i]);
    if (w.zero) zacc[i] = _mm256_fmadd_ps(zeros, _mm256_set1_ps(x.sum[(m0 + i) * nb + b]), zacc[i]);
  }
}

// Row group g's outputs for activation rows m0 .. m0 + M: acc (+ zacc), the padding rows dropped.
template <int M>
RADIXLM_AVX2 inline void store_group(const TiledMatrix& w, int64_t g, int64_t m0, const __m256 (&acc)[M],
                                     const __m256 (&zacc)[M], float* y) {
  const int64_t first = g * kTileRows, valid = std::min<int64_t>(kTileRows, w.rows - first);
  for (int i = 0; i < M; ++i) {
    const __m256 out = w.zero ? _mm256_add_ps(acc[i], zacc[i]) : acc[i];
    float* dst = y + (m0 + i) * w.rows + first;
    if (valid == kTileRows) {
      _mm256_storeu_ps(dst, out);
    } else {
      alignas(32) float part[kTileRows];
      _mm256_store_ps(part, out);
      for (int64_t r = 0; r < valid; ++r) dst[r] = part[r];
    }
  }
}

}  // namespace radixlm
