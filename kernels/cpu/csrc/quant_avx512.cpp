// The AVX-512 path of the quantized matmul (F, BW, VL and VNNI: Intel from Cascade Lake, AMD from
// Zen 4). Bitwise the portable path's results: the integer dots are exact whatever the order they
// are summed in, and the floating-point part is the AVX2 path's, the same multiply-adds in the
// same order at 16 lanes. Built by target attributes, like the AVX2 file; runs only where cpuid
// found all four.
//
// A 512-bit register holds one chunk of two row groups' tiles (16 rows, a lane each), so an
// activation pair is a plain broadcast (folded into the multiply-add) and one VNNI multiply-add
// (vpdpwssd) sums two columns of 16 rows. Two tile streams are read side by side; a matrix with
// an odd number of groups runs its last one in the low half alone.
#include "common.h"  // RADIXLM_X86: the vector paths are built on x86 only
#if RADIXLM_X86

#include <algorithm>
#include <cstring>

#include "avx2.h"
#include "quant_tile.h"

#define RADIXLM_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace radixlm {
namespace {

RADIXLM_AVX512 inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

RADIXLM_AVX512 inline __m512 join(__m256 low, __m256 high) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
}

// 32 bytes at a and at b (b null: zeros) as one register
RADIXLM_AVX512 inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return join(low, b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)) : _mm256_setzero_si256());
}

template <int N>
RADIXLM_AVX512 inline __m512i shift32(__m512i v) {
  if constexpr (N > 0) return _mm512_srli_epi32(v, N);
  else if constexpr (N < 0) return _mm512_slli_epi32(v, -N);
  else return v;
}

// quant_tile.h's codes4 at 16 lanes: pair pair4(T, k)'s codes of both groups' chunk T
template <Codes K, int T, int k>
RADIXLM_AVX512 inline __m512i codes4(__m512i v, const __m512i (&high)[2]) {
  constexpr int q = pair4(T, k);
  if constexpr (K == Codes::f4) {
    const __m512i at_high = k < 2 ? _mm512_slli_epi16(v, 8 - 4 * k) : k == 2 ? v : _mm512_srli_epi16(v, 4);
    const __m512i index = _mm512_and_si512(at_high, _mm512_set1_epi16(0x0F00));
    const __m512i table = _mm512_broadcast_i64x4(e2m1_table());
    return _mm512_srai_epi16(_mm512_shuffle_epi8(table, index), 8);
  } else {
    __m512i c = k == 0 ? v : _mm512_srli_epi16(v, 4 * k);
    if (k != 3) c = _mm512_and_si512(c, _mm512_set1_epi16(0x0F));
    if constexpr (K == Codes::s4) c = _mm512_sub_epi16(c, _mm512_set1_epi16(8));
    if constexpr (K == Codes::k5)
      c = _mm512_or_si512(c, _mm512_and_si512(shift32<q - 4>(high[0]), _mm512_set1_epi32(0x00100010)));
    if constexpr (K == Codes::k6) {
      c = _mm512_or_si512(c, _mm512_and_si512(shift32<2 * (q % 8) - 4>(high[q / 8]), _mm512_set1_epi32(0x00300030)));
      c = _mm512_sub_epi16(c, _mm512_set1_epi16(32));
    }
    return c;
  }
}

template <int M>
RADIXLM_AVX512 inline void multiply_add(__m512i codes, const int16_t* const (&xq)[M], int q, __m512i (&dots)[M][2],
                                        int h) {
  for (int i = 0; i < M; ++i) {
    int32_t v;
    std::memcpy(&v, xq[i] + 2 * q, sizeof v);
    dots[i][h] = _mm512_dpwssd_epi32(dots[i][h], codes, _mm512_set1_epi32(v));
  }
}

template <Codes K, int M, int T = 0>
RADIXLM_AVX512 inline void dots4(const uint8_t* a, const uint8_t* b, const __m512i (&high)[2],
                                 const int16_t* const (&xq)[M], __m512i (&dots)[M][2]) {
  const __m512i v = load_pair(a + 32 * T, b ? b + 32 * T : nullptr);
  multiply_add<M>(codes4<K, T, 0>(v, high), xq, pair4(T, 0), dots, 0);
  multiply_add<M>(codes4<K, T, 2>(v, high), xq, pair4(T, 2), dots, 0);
  multiply_add<M>(codes4<K, T, 1>(v, high), xq, pair4(T, 1), dots, halves(K) - 1);  // columns 16..31
  multiply_add<M>(codes4<K, T, 3>(v, high), xq, pair4(T, 3), dots, halves(K) - 1);
  if constexpr (T < 3) dots4<K, M, T + 1>(a, b, high, xq, dots);
}

// Activation rows m0 .. m0 + M against row groups g and g + 1 (`pair`; else g alone).
template <Codes K, int M>
RADIXLM_AVX512 void groups_rows(const QuantizedActivations& x, const TileStream& w, int64_t m0, int64_t g, bool pair,
                                float* y, int64_t y_stride) {
  const Layout& l = w.layout;
  const int64_t nb = x.blocks();
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* pa = w.group(g);
  const uint8_t* pb = pair ? w.group(g + 1) : nullptr;
  KHeader ha{}, hb{};
  const int64_t tile = l.tile();
  for (int64_t b = 0; b < w.blocks; ++b) {
    if (is_k(K) && b % kSuperBlocks == 0) {
      ha = k_header<K>(pa);
      pa += l.header;
      if (pair) {
        hb = k_header<K>(pb);
        pb += l.header;
      }
    }
    if (m0 == 0) {  // the first pass over these groups reads them from memory; the others from L1
      prefetch_tile(pa, tile);
      if (pair) prefetch_tile(pb, tile);
    }
    __m256 sa[2], sb[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, za = _mm256_setzero_ps(), zb = za;
    tile_scales<K>(w, ha, pa, sa, za);
    if (pair) tile_scales<K>(w, hb, pb, sb, zb);
    const __m512 scale[2] = {join(sa[0], sb[0]), join(sa[1], sb[1])}, zero = join(za, zb);
    const uint8_t* ca = pa + l.scales + l.zeros;
    const uint8_t* cb = pair ? pb + l.scales + l.zeros : nullptr;
    const int16_t* xq[M];
    for (int i = 0; i < M; ++i) xq[i] = x.q + (m0 + i) * x.cols + b * kBlock;
    __m512i dots[M][2];
    for (int i = 0; i < M; ++i) dots[i][0] = dots[i][1] = _mm512_setzero_si512();
    if constexpr (K == Codes::s8) {
      for (int c = 0; c < 8; ++c) {
        const __m512i v = load_pair(ca + 32 * c, cb ? cb + 32 * c : nullptr);
        multiply_add<M>(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), xq, 2 * c, dots, 0);
        multiply_add<M>(_mm512_srai_epi16(v, 8), xq, 2 * c + 1, dots, 0);
      }
    } else {
      __m512i high[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      if constexpr (K == Codes::k5 || K == Codes::k6)
        for (int p = 0; p < (K == Codes::k6 ? 2 : 1); ++p)
          high[p] = load_pair(ca + l.codes + 32 * p, cb ? cb + l.codes + 32 * p : nullptr);
      dots4<K, M>(ca, cb, high, xq, dots);
    }
    for (int i = 0; i < M; ++i) {  // quant_tile.h's scale_block at 16 lanes
      const __m512 d = _mm512_set1_ps(x.d[(m0 + i) * nb + b]);
      if constexpr (has_zero(K)) {
        const __m512 z = _mm512_mul_ps(zero, _mm512_set1_ps(x.sum[(m0 + i) * nb + b]));
        acc[i] = _mm512_add_ps(acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i][0]), _mm512_mul_ps(scale[0], d), z));
      } else {
        for (int h = 0; h < halves(K); ++h)
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i][h]), _mm512_mul_ps(scale[h], d), acc[i]);
      }
    }
    pa += tile;
    if (pair) pb += tile;
  }
  const int64_t first = g * kTileRows, valid = std::min<int64_t>(pair ? 2 * kTileRows : kTileRows, w.rows - first);
  const __mmask16 keep = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int i = 0; i < M; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * y_stride + first, keep, acc[i]);
}

template <Codes K>
RADIXLM_AVX512 void groups(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                           int64_t y_stride) {
  for (int64_t g = g0; g < g1; g += 2) {  // two groups' tiles (a few KB) stay in L1 across the activation rows
    const bool pair = g + 1 < g1;
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) groups_rows<K, 4>(x, w, m, g, pair, y, y_stride);
    switch (x.rows - m) {
      case 3: groups_rows<K, 3>(x, w, m, g, pair, y, y_stride); break;
      case 2: groups_rows<K, 2>(x, w, m, g, pair, y, y_stride); break;
      case 1: groups_rows<K, 1>(x, w, m, g, pair, y, y_stride); break;
      default: break;
    }
  }
}

}  // namespace

void matmul_stream_avx512(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
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

}  // namespace radixlm

#endif  // RADIXLM_X86
