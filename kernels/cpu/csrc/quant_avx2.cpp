// The AVX2 path of the quantized matmul (AVX2, FMA, F16C: every x86 CPU since 2013-2015).
// Bitwise the portable path's results: the same exact integer dots, the same fused multiply-adds
// in the same order. Built for AVX2 by target attributes, so the library
// loads on any x86 CPU and this code runs only where the dispatcher found AVX2.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "avx2.h"
#include "common.h"
#include "quant_tile.h"

namespace radixlm {
namespace {

// Activation columns 2p and 2p + 1 in every 32-bit lane.
RADIXLM_AVX2 inline __m256i pair(const int16_t* x, int p) {
  int32_t v;
  std::memcpy(&v, x + 2 * p, sizeof v);
  return _mm256_set1_epi32(v);
}

// Activation rows m0 .. m0 + M against row group g: per block, each activation row's 8 integer
// dots (one lane a weight row) from a multiply-add per column pair, the chunk's codes unpacked
// once for the M rows; then scaled and added into each row's accumulator, as the portable path.
template <int Bits, int Group, int M>
RADIXLM_AVX2 void group_rows(const QuantizedActivations& x, const TiledMatrix& w, int64_t m0, int64_t g, float* y) {
  constexpr int Halves = Group == 16 ? 2 : 1;
  const int64_t nb = w.blocks(), tile = w.tile_bytes(), code_at = w.scale_bytes() + w.zero_bytes();
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  __m256 acc[M], zacc[M];
  for (int i = 0; i < M; ++i) acc[i] = zacc[i] = _mm256_setzero_ps();
  const uint8_t* t = w.tiles + g * nb * tile;
  for (int64_t b = 0; b < nb; ++b, t += tile) {
    const uint8_t* chunks = t + code_at;
    __m256i dots[M][Halves];
    for (int i = 0; i < M; ++i)
      for (int h = 0; h < Halves; ++h) dots[i][h] = _mm256_setzero_si256();
    if constexpr (Bits == 4) {
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * j));
        const __m256i codes[4] = {_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 8), nibble), _mm256_srli_epi16(v, 12)};
        for (int i = 0; i < M; ++i) {
          const int16_t* xq = x.q + (m0 + i) * x.cols + b * kBlock;
          for (int k = 0; k < 4; ++k) dots[i][0] = _mm256_add_epi32(dots[i][0], _mm256_madd_epi16(codes[k], pair(xq, 4 * j + k)));
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * j));
        const __m256i low = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), high = _mm256_srai_epi16(v, 8);
        const int h = Halves == 2 ? j / 4 : 0;
        for (int i = 0; i < M; ++i) {
          const int16_t* xq = x.q + (m0 + i) * x.cols + b * kBlock;
          dots[i][h] = _mm256_add_epi32(dots[i][h], _mm256_madd_epi16(low, pair(xq, 2 * j)));
          dots[i][h] = _mm256_add_epi32(dots[i][h], _mm256_madd_epi16(high, pair(xq, 2 * j + 1)));
        }
      }
    }
    scale_block<Halves, M>(x, w, t, m0, b, dots, acc, zacc);
  }
  store_group<M>(w, g, m0, acc, zacc, y);
}

template <int Bits, int Group>
RADIXLM_AVX2 void groups(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y) {
  for (int64_t g = g0; g < g1; ++g) {  // a group's tiles (a few KB) stay in L1 across the activation rows
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) group_rows<Bits, Group, 4>(x, w, m, g, y);
    switch (x.rows - m) {
      case 3: group_rows<Bits, Group, 3>(x, w, m, g, y); break;
      case 2: group_rows<Bits, Group, 2>(x, w, m, g, y); break;
      case 1: group_rows<Bits, Group, 1>(x, w, m, g, y); break;
      default: break;
    }
  }
}

}  // namespace

void matmul_groups_avx2(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y) {
  if (w.bits == 4)
    groups<4, 32>(x, w, g0, g1, y);
  else if (w.group == 16)
    groups<8, 16>(x, w, g0, g1, y);
  else
    groups<8, 32>(x, w, g0, g1, y);
}

RADIXLM_AVX2 void quantize_rows_avx2(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum) {
  const int64_t nb = cols / kBlock;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * cols + b * kBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float top = _mm_cvtss_f32(m4);
      const float scale = top / 32767.0f;
      const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
      __m256i ints[4];
      __m256i total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        ints[i] = _mm256_cvtps_epi32(rounded);
        total = _mm256_add_epi32(total, ints[i]);
      }
      // int32 -> int16 in column order (packs interleave 128-bit lanes: put them back)
      int16_t* dst = q + r * cols + b * kBlock;
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_packs_epi32(ints[2 * h], ints[2 * h + 1]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), _mm256_permute4x64_epi64(packed, 0xD8));
      }
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      d[r * nb + b] = scale;
      sum[r * nb + b] = scale * float(_mm_cvtsi128_si32(t4));
    }
  }
}

}  // namespace radixlm
