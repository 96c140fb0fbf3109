// A tile read with AVX2 (tiles.h's layout): its scales as 8-lane vectors and its codes as 16-bit
// pairs, one vector per column pair with a lane per row; and a block's dots scaled into the
// activation rows' accumulators. Shared by the AVX2 and AVX-512 paths (an AVX-512 function,
// whose target includes AVX2, inlines these), so every path does the same operations in the same
// order: each bitwise the portable path.
#pragma once

#include <algorithm>

#include "avx2.h"
#include "common.h"

namespace radixlm {

// How far ahead of the tile being read a matmul asks for the stream's next lines. A row group's
// tiles are a few KB, so the hardware prefetcher, which ramps up anew at each 4 KB page and each
// group, leaves a batch-1 pass waiting on memory; asking for every line of a tile this far ahead
// keeps enough misses in flight.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_tile(const uint8_t* tile, int64_t bytes) {
  if constexpr (kPrefetchBytes > 0)
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(tile + kPrefetchBytes + off, 0, 3);
}

RADIXLM_AVX2 inline __m256 load8(const uint8_t* p, bool wide) {
  return wide ? _mm256_loadu_ps(reinterpret_cast<const float*>(p))
              : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

RADIXLM_AVX2 inline __m256 bytes8(const uint8_t* p, bool is_signed) {  // 8 bytes as floats
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// 2^(e - 128) for 8 exponent bytes (MXFP4's E8M0 halved: its codes are twice the E2M1 values);
// e = 0 and 1 are subnormal
RADIXLM_AVX2 inline __m256 e8m0_halves(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_srlv_epi32(_mm256_set1_epi32(0x00400000), _mm256_sub_epi32(_mm256_set1_epi32(1), e));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}

// A K format's super-block header as vectors: d and (k4, k5) dmin, a lane per row.
struct KHeader {
  __m256 d, dmin;
};

template <Codes K>
RADIXLM_AVX2 inline KHeader k_header(const uint8_t* head) {
  if constexpr (K == Codes::k4 || K == Codes::k5) return {load8(head, false), load8(head + 16, false)};
  else if constexpr (K == Codes::k6) return {load8(head, false), _mm256_setzero_ps()};
  else return {_mm256_setzero_ps(), _mm256_setzero_ps()};
}

// Tile t's scales (one vector per sub-block h, a lane per row) and zero points (K formats: from
// its super-block's header, `head`).
template <Codes K>
RADIXLM_AVX2 inline void tile_scales(const TileStream& w, const KHeader& head, const uint8_t* t, __m256 (&scale)[2],
                                     __m256& zero) {
  if constexpr (K == Codes::u4 || K == Codes::s4 || K == Codes::s8) {
    scale[0] = load8(t, w.wide);
    if constexpr (K == Codes::u4) zero = load8(t + w.layout.scales, w.wide);
  } else if constexpr (K == Codes::k4 || K == Codes::k5) {
    scale[0] = _mm256_mul_ps(head.d, bytes8(t, false));
    zero = _mm256_xor_ps(_mm256_mul_ps(head.dmin, bytes8(t + 8, false)), _mm256_set1_ps(-0.0f));
  } else if constexpr (K == Codes::k6) {
    scale[0] = _mm256_mul_ps(head.d, bytes8(t, true));
    scale[1] = _mm256_mul_ps(head.d, bytes8(t + 8, true));
  } else {
    scale[0] = e8m0_halves(t);
  }
}

// The pair a 4-bit chunk's codes shifted by 4k hold (tiles.h)
constexpr int pair4(int t, int k) { return 2 * t + (k == 0 ? 0 : k == 1 ? 8 : k == 2 ? 1 : 9); }

// Lanes shifted right by n bits (left by -n)
template <int N>
RADIXLM_AVX2 inline __m256i shift32(__m256i v) {
  if constexpr (N > 0) return _mm256_srli_epi32(v, N);
  else if constexpr (N < 0) return _mm256_slli_epi32(v, -N);
  else return v;
}

// MXFP4's values times 2 by 4-bit code, in a byte shuffle's table (both 128-bit lanes)
RADIXLM_AVX2 inline __m256i e2m1_table() {
  return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2,
                          -3, -4, -6, -8, -12);
}

// Pair pair4(T, k)'s codes of a 4-bit format's chunk T (v: its 32 bytes; high: the tile's high
// bits) as 16-bit integers, a 32-bit lane per row.
template <Codes K, int T, int k>
RADIXLM_AVX2 inline __m256i codes4(__m256i v, const uint8_t* high) {
  constexpr int q = pair4(T, k);
  if constexpr (K == Codes::f4) {  // the code into each 16-bit half's high byte, looked up, sign-extended
    const __m256i at_high = k < 2 ? _mm256_slli_epi16(v, 8 - 4 * k) : k == 2 ? v : _mm256_srli_epi16(v, 4);
    const __m256i index = _mm256_and_si256(at_high, _mm256_set1_epi16(0x0F00));
    return _mm256_srai_epi16(_mm256_shuffle_epi8(e2m1_table(), index), 8);
  } else {
    __m256i c = k == 0 ? v : _mm256_srli_epi16(v, 4 * k);
    if (k != 3) c = _mm256_and_si256(c, _mm256_set1_epi16(0x0F));
    if constexpr (K == Codes::s4) c = _mm256_sub_epi16(c, _mm256_set1_epi16(8));
    if constexpr (K == Codes::k5) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
      c = _mm256_or_si256(c, _mm256_and_si256(shift32<q - 4>(bits), _mm256_set1_epi32(0x00100010)));
    }
    if constexpr (K == Codes::k6) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 32 * (q / 8)));
      c = _mm256_or_si256(c, _mm256_and_si256(shift32<2 * (q % 8) - 4>(bits), _mm256_set1_epi32(0x00300030)));
      c = _mm256_sub_epi16(c, _mm256_set1_epi16(32));
    }
    return c;
  }
}

// s8 chunk t: its low bytes (pair 2t) and high bytes (pair 2t + 1), sign-extended.
RADIXLM_AVX2 inline __m256i codes8_low(__m256i v) { return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8); }
RADIXLM_AVX2 inline __m256i codes8_high(__m256i v) { return _mm256_srai_epi16(v, 8); }

RADIXLM_AVX2 inline __m256i chunk_at(const uint8_t* chunks, int t) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * t));
}

// Every pair of a tile, pairs[q], for the panel unpack (the streaming kernels use codes4 as they go).
template <Codes K, int T = 0>
RADIXLM_AVX2 inline void tile_pairs(const uint8_t* chunks, const uint8_t* high, __m256i (&pairs)[16]) {
  if constexpr (K == Codes::s8) {
    for (int t = 0; t < 8; ++t) {
      const __m256i v = chunk_at(chunks, t);
      pairs[2 * t] = codes8_low(v);
      pairs[2 * t + 1] = codes8_high(v);
    }
  } else {
    const __m256i v = chunk_at(chunks, T);
    pairs[pair4(T, 0)] = codes4<K, T, 0>(v, high);
    pairs[pair4(T, 1)] = codes4<K, T, 1>(v, high);
    pairs[pair4(T, 2)] = codes4<K, T, 2>(v, high);
    pairs[pair4(T, 3)] = codes4<K, T, 3>(v, high);
    if constexpr (T < 3) tile_pairs<K, T + 1>(chunks, high, pairs);
  }
}

// Block b's dots (integers, a lane per weight row) scaled into activation row m0 + i's
// accumulator: with zero points acc += fma(dot, scale d, zero sum), else acc = fma(dot_h,
// scale_h d, acc) per sub-block h in order (the portable path's operations).
template <Codes K, int M>
RADIXLM_AVX2 inline void scale_block(const QuantizedActivations& x, int64_t m0, int64_t b, const __m256 (&scale)[2],
                                     __m256 zero, const __m256i (&dots)[M][2], __m256 (&acc)[M]) {
  const int64_t nb = x.blocks();
  for (int i = 0; i < M; ++i) {
    const __m256 d = _mm256_set1_ps(x.d[(m0 + i) * nb + b]);
    if constexpr (has_zero(K)) {
      const __m256 z = _mm256_mul_ps(zero, _mm256_set1_ps(x.sum[(m0 + i) * nb + b]));
      acc[i] = _mm256_add_ps(acc[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i][0]), _mm256_mul_ps(scale[0], d), z));
    } else {
      for (int h = 0; h < halves(K); ++h)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i][h]), _mm256_mul_ps(scale[h], d), acc[i]);
    }
  }
}

// Row group g's outputs for activation rows m0 .. m0 + M, the padding rows dropped.
template <int M>
RADIXLM_AVX2 inline void store_group(const TileStream& w, int64_t g, int64_t m0, const __m256 (&acc)[M], float* y,
                                     int64_t y_stride) {
  const int64_t first = g * kTileRows, valid = std::min<int64_t>(kTileRows, w.rows - first);
  for (int i = 0; i < M; ++i) {
    float* dst = y + (m0 + i) * y_stride + first;
    if (valid == kTileRows) {
      _mm256_storeu_ps(dst, acc[i]);
    } else {
      alignas(32) float part[kTileRows];
      _mm256_store_ps(part, acc[i]);
      for (int64_t r = 0; r < valid; ++r) dst[r] = part[r];
    }
  }
}

}  // namespace radixlm
