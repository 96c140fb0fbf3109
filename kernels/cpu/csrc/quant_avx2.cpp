// The AVX2 path of the quantized matmul (AVX2, FMA, F16C: every x86 CPU since 2013-2015).
// Bitwise the portable path's results: the same integer lanes, the same fused multiply-adds in
// the same order, the same horizontal sum. Built for AVX2 by target attributes, so the library
// loads on any x86 CPU and this code runs only where the dispatcher found AVX2.
#include <cmath>

#include "avx2.h"
#include "common.h"

namespace radixlm {
namespace {

RADIXLM_AVX2 inline float load_scale(const void* p, int64_t i, bool half) {
  return half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

RADIXLM_AVX2 inline __m256 load8(const void* p, int64_t i, bool half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
              : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

// One weight group's 32 codes widened to 16 bits: columns 0-15 and 16-31.
template <int Bits>
RADIXLM_AVX2 inline void widen(const uint8_t* p, __m256i& first, __m256i& second) {
  if constexpr (Bits == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    first = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
    second = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
  } else {
    first = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    second = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
}

// lane l: columns 2l, 2l+1, 16+2l, 17+2l (as block_lanes in quant_portable.cpp)
RADIXLM_AVX2 inline __m256i block_dot(__m256i first, __m256i second, const int16_t* x) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(first, x0), _mm256_madd_epi16(second, x1));
}

// An output's zero-point term, added to its lanes' sum: as the portable path.
RADIXLM_AVX2 float finish(const QuantizedActivations& x, const CodeMatrix& w, int64_t m, int64_t n, __m256 acc) {
  if (w.zero == nullptr) return hsum(acc) + 0.0f;  // the portable path adds an empty zero sum: -0 alike
  const int64_t nb = w.blocks();
  const float* xs = x.sum + m * nb;
  __m256 zacc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) zacc = _mm256_fmadd_ps(load8(w.zero, n * nb + b, w.half), _mm256_loadu_ps(xs + b), zacc);
  float out = hsum(acc) + hsum(zacc);
  for (; b < nb; ++b) out = std::fma(load_scale(w.zero, n * nb + b, w.half), xs[b], out);
  return out;
}

// Output rows n0 .. n0 + N of w against activation rows m0 .. m0 + M: each weight group is
// widened once for the M activation rows, and the N x M accumulators are independent chains of
// multiply-adds (one chain would wait on each add's latency). Every output still sums its own
// blocks in order.
template <int Bits, int M, int N, int Group = 32>
RADIXLM_AVX2 void tile(const QuantizedActivations& x, const CodeMatrix& w, int64_t m0, int64_t n0, float* y) {
  constexpr int64_t group_bytes = Bits * kBlock / 8;
  constexpr int64_t per_block = kBlock / Group;  // scales per block of 32
  const int64_t nb = w.blocks();
  __m256 acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i first[N], second[N];
    float ws[N][per_block];
    for (int j = 0; j < N; ++j) {
      widen<Bits>(w.codes + (n0 + j) * w.row_bytes() + b * group_bytes, first[j], second[j]);
      for (int h = 0; h < per_block; ++h) ws[j][h] = load_scale(w.scale, ((n0 + j) * nb + b) * per_block + h, w.half);
    }
    for (int i = 0; i < M; ++i) {
      const int64_t m = m0 + i;
      const int16_t* xq = x.q + m * x.cols + b * kBlock;
      const float xd = x.d[m * nb + b];
      for (int j = 0; j < N; ++j) {
        if constexpr (Group == 16) {  // each half its own scale (as the portable path)
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(first[j], x0)), _mm256_set1_ps(ws[j][0] * xd), acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(second[j], x1)), _mm256_set1_ps(ws[j][1] * xd), acc[i][j]);
        } else {
          const __m256 lanes = _mm256_cvtepi32_ps(block_dot(first[j], second[j], xq));
          acc[i][j] = _mm256_fmadd_ps(lanes, _mm256_set1_ps(ws[j][0] * xd), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) y[(m0 + i) * w.rows + n0 + j] = finish(x, w, m0 + i, n0 + j, acc[i][j]);
}

// Weight rows asked from memory this far ahead of the tile that reads them: a decode step's
// matrices stream from DRAM, and a few KB in flight keep more of its bandwidth busy.
constexpr int64_t kPrefetchRows = 16;

template <int Bits, int M, int N, int Group>
RADIXLM_AVX2 void sweep(const QuantizedActivations& x, const CodeMatrix& w, int64_t m0, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + N <= n1; n += N) {
    if (n + kPrefetchRows + N <= n1) {
      const char* ahead = reinterpret_cast<const char*>(w.codes + (n + kPrefetchRows) * w.row_bytes());
      for (int64_t off = 0; off < N * w.row_bytes(); off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    tile<Bits, M, N, Group>(x, w, m0, n, y);
  }
  for (; n < n1; ++n) tile<Bits, M, 1, Group>(x, w, m0, n, y);
}

template <int Bits, int Group = 32>
RADIXLM_AVX2 void rows(const QuantizedActivations& x, const CodeMatrix& w, int64_t n0, int64_t n1, float* y) {
  int64_t m = 0;
  for (; m + 4 <= x.rows; m += 4) sweep<Bits, 4, 2, Group>(x, w, m, n0, n1, y);  // 8 accumulators
  for (; m < x.rows; ++m) sweep<Bits, 1, 4, Group>(x, w, m, n0, n1, y);          // 4 chains for a lone row
}

}  // namespace

void matmul_rows_avx2(const QuantizedActivations& x, const CodeMatrix& w, int64_t n0, int64_t n1, float* y) {
  if (w.bits == 4)
    rows<4>(x, w, n0, n1, y);
  else if (w.group == 16)
    rows<8, 16>(x, w, n0, n1, y);
  else
    rows<8>(x, w, n0, n1, y);
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
