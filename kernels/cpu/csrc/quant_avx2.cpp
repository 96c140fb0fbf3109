// The AVX2 path of the quantized matmul (AVX2, FMA, F16C: every x86 CPU since 2013-2015).
// Bitwise the portable path's results: the same exact integer dots, the same fused multiply-adds
// in the same order. Built for AVX2 by target attributes, so the library loads on any x86 CPU and
// this code runs only where the dispatcher found AVX2.
#include "common.h"  // RADIXLM_X86: the vector paths are built on x86 only
#if RADIXLM_X86

#include <cmath>
#include <cstring>

#include "avx2.h"
#include "quant_tile.h"

namespace radixlm {
namespace {

// Activation pair q of a block (pair order: one 32-bit load) in every lane.
RADIXLM_AVX2 inline __m256i pair(const int16_t* xq, int q) {
  int32_t v;
  std::memcpy(&v, xq + 2 * q, sizeof v);
  return _mm256_set1_epi32(v);
}

template <int M>
RADIXLM_AVX2 inline void multiply_add(__m256i codes, const int16_t* const (&xq)[M], int q, __m256i (&dots)[M][2], int h) {
  for (int i = 0; i < M; ++i) dots[i][h] = _mm256_add_epi32(dots[i][h], _mm256_madd_epi16(codes, pair(xq[i], q)));
}

// A 4-bit format's chunks T..3 of one tile against M activation rows.
template <Codes K, int M, int T = 0>
RADIXLM_AVX2 inline void dots4(const uint8_t* chunks, const uint8_t* high, const int16_t* const (&xq)[M],
                               __m256i (&dots)[M][2]) {
  const __m256i v = chunk_at(chunks, T);
  multiply_add<M>(codes4<K, T, 0>(v, high), xq, pair4(T, 0), dots, 0);
  multiply_add<M>(codes4<K, T, 2>(v, high), xq, pair4(T, 2), dots, 0);
  // columns 16..31: Q6_K's second sub-block
  multiply_add<M>(codes4<K, T, 1>(v, high), xq, pair4(T, 1), dots, halves(K) - 1);
  multiply_add<M>(codes4<K, T, 3>(v, high), xq, pair4(T, 3), dots, halves(K) - 1);
  if constexpr (T < 3) dots4<K, M, T + 1>(chunks, high, xq, dots);
}

// Activation rows m0 .. m0 + M against row group g: per block, each activation row's 8 integer
// dots (a lane a weight row) from a multiply-add per column pair, the chunk's codes unpacked once
// for the M rows; then scaled into each row's accumulator, as the portable path.
template <Codes K, int M>
RADIXLM_AVX2 void group_rows(const QuantizedActivations& x, const TileStream& w, int64_t m0, int64_t g, float* y,
                             int64_t y_stride) {
  const Layout& l = w.layout;
  __m256 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
  const uint8_t* p = w.group(g);
  KHeader head{};
  for (int64_t b = 0; b < w.blocks; ++b) {
    if (is_k(K) && b % kSuperBlocks == 0) {
      head = k_header<K>(p);
      p += l.header;
    }
    const uint8_t* t = p;
    p += l.tile();
    if (m0 == 0) prefetch_tile(t, l.tile());  // the first pass over the group reads it from memory
    __m256 scale[2], zero = _mm256_setzero_ps();
    tile_scales<K>(w, head, t, scale, zero);
    const uint8_t* chunks = t + l.scales + l.zeros;
    const int16_t* xq[M];
    for (int i = 0; i < M; ++i) xq[i] = x.q + (m0 + i) * x.cols + b * kBlock;
    __m256i dots[M][2];
    for (int i = 0; i < M; ++i) dots[i][0] = dots[i][1] = _mm256_setzero_si256();
    if constexpr (K == Codes::s8) {
      for (int c = 0; c < 8; ++c) {
        const __m256i v = chunk_at(chunks, c);
        multiply_add<M>(codes8_low(v), xq, 2 * c, dots, 0);
        multiply_add<M>(codes8_high(v), xq, 2 * c + 1, dots, 0);
      }
    } else {
      dots4<K, M>(chunks, chunks + l.codes, xq, dots);
    }
    scale_block<K, M>(x, m0, b, scale, zero, dots, acc);
  }
  store_group<M>(w, g, m0, acc, y, y_stride);
}

template <Codes K>
RADIXLM_AVX2 void groups(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                         int64_t y_stride) {
  for (int64_t g = g0; g < g1; ++g) {  // a group's tiles (a few KB) stay in L1 across the activation rows
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) group_rows<K, 4>(x, w, m, g, y, y_stride);
    switch (x.rows - m) {
      case 3: group_rows<K, 3>(x, w, m, g, y, y_stride); break;
      case 2: group_rows<K, 2>(x, w, m, g, y, y_stride); break;
      case 1: group_rows<K, 1>(x, w, m, g, y, y_stride); break;
      default: break;
    }
  }
}

}  // namespace

void matmul_stream_avx2(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                        int64_t y_stride) {
  switch (w.kind) {
    case Codes::u4: return groups<Codes::u4>(x, w, g0, g1, y, y_stride);
    case Codes::s4: return groups<Codes::s4>(x, w, g0, g1, y, y_stride);
    case Codes::s8: return groups<Codes::s8>(x, w, g0, g1, y, y_stride);
    case Codes::k4: return groups<Codes::k4>(x, w, g0, g1, y, y_stride);
    case Codes::k5: return groups<Codes::k5>(x, w, g0, g1, y, y_stride);
    case Codes::k6: return groups<Codes::k6>(x, w, g0, g1, y, y_stride);
    case Codes::f4: return groups<Codes::f4>(x, w, g0, g1, y, y_stride);
  }
}

RADIXLM_AVX2 void quantize_rows_avx2(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum) {
  const int64_t nb = cols / kBlock;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  // int16 elements 0, 2, 1, 3 of every 4 (pair order), within each 128-bit lane
  const __m256i to_pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7,
                                            8, 9, 12, 13, 10, 11, 14, 15);
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
      const BlockScale scale = block_scale(_mm_cvtss_f32(m4));
      const __m256 inv = _mm256_set1_ps(scale.inv);
      __m256i ints[4];
      __m256i total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        ints[i] = _mm256_cvtps_epi32(rounded);
        total = _mm256_add_epi32(total, ints[i]);
      }
      // int32 -> int16 in column order (packs interleave 128-bit lanes: put them back), then pair order
      int16_t* dst = q + r * cols + b * kBlock;
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2 * h], ints[2 * h + 1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), _mm256_shuffle_epi8(packed, to_pairs));
      }
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      d[r * nb + b] = scale.d;
      sum[r * nb + b] = scale.d * float(_mm_cvtsi128_si32(t4));
    }
  }
}

}  // namespace radixlm

#endif  // RADIXLM_X86
