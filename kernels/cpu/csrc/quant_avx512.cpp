// The AVX-512 path of the quantized matmul (F, BW, VL and VNNI: Intel from Cascade Lake, AMD from
// Zen 4). Bitwise the portable path's results: the integer dots are exact whatever the order they
// are summed in, and the floating-point part is the AVX2 path's, the same multiply-adds in the
// same order. Built by target attributes, like the AVX2 file; runs only where cpuid found all four.
//
// A 512-bit register holds two 32-byte code chunks of a tile (8 rows x 4 column pairs each); the
// activations' pairs for the two halves come from a table made once per call (`Spread`): for each
// block, 8 vectors of 16 32-bit lanes, the low 8 lanes one pair broadcast, the high 8 the pair the
// upper chunk needs. One VNNI multiply-add (vpdpwssd) then sums two column pairs of 8 rows, where
// AVX2 took a multiply-add and an add for one; the two halves are added once a block.
#include <algorithm>
#include <cstring>
#include <vector>

#include "avx2.h"
#include "common.h"
#include "quant_tile.h"

#define RADIXLM_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace radixlm {
namespace {

constexpr int kSpread = 8;  // table vectors per block: 4-bit (2 chunk pairs x 4 nibbles), 8-bit (4 x 2 bytes)

// The activation column pair a table vector carries in its low (chunk 2c) and high (chunk 2c + 1) half.
inline void spread_pairs(int bits, int e, int* low, int* high) {
  if (bits == 4) {  // e = 4c + k: chunk j covers pairs 4j + k
    const int c = e / 4, k = e % 4;
    *low = 4 * (2 * c) + k;
    *high = 4 * (2 * c + 1) + k;
  } else {  // e = 2c + s: chunk j's low bytes are pair 2j, its high bytes pair 2j + 1
    const int c = e / 2, s = e % 2;
    *low = 2 * (2 * c) + s;
    *high = 2 * (2 * c + 1) + s;
  }
}

// Plain int32 storage, read and written with unaligned loads and stores only: a vector of
// __m512i would lose the type's 64-byte alignment (GCC drops vector attributes on template
// arguments), and an aligned store into it faults.
struct Spread {
  std::vector<int32_t> v;  // [rows, blocks, kSpread, 16]
  int64_t blocks = 0;
  const int32_t* at(int64_t m, int64_t b) const { return v.data() + (m * blocks + b) * kSpread * 16; }
};

RADIXLM_AVX512 void make_spread(const QuantizedActivations& x, int bits, Spread& s) {
  s.blocks = x.blocks();
  s.v.resize(size_t(x.rows * s.blocks * kSpread * 16));
  for (int64_t m = 0; m < x.rows; ++m)
    for (int64_t b = 0; b < s.blocks; ++b) {
      const int16_t* xq = x.q + m * x.cols + b * kBlock;
      int32_t* dst = s.v.data() + (m * s.blocks + b) * kSpread * 16;
      for (int e = 0; e < kSpread; ++e) {
        int low, high;
        spread_pairs(bits, e, &low, &high);
        int32_t lo, hi;
        std::memcpy(&lo, xq + 2 * low, sizeof lo);
        std::memcpy(&hi, xq + 2 * high, sizeof hi);
        _mm512_storeu_si512(dst + 16 * e,
                            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(lo)), _mm256_set1_epi32(hi), 1));
      }
    }
}

RADIXLM_AVX512 inline __m512i spread_at(const int32_t* xs, int e) { return _mm512_loadu_si512(xs + 16 * e); }

RADIXLM_AVX512 inline __m256i halves_added(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

template <int Bits, int Group, int M>
RADIXLM_AVX512 void group_rows(const QuantizedActivations& x, const Spread& spread, const TiledMatrix& w, int64_t m0,
                               int64_t g, float* y) {
  constexpr int Halves = Group == 16 ? 2 : 1;
  const int64_t nb = w.blocks(), tile = w.tile_bytes(), code_at = w.scale_bytes() + w.zero_bytes();
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  __m256 acc[M], zacc[M];
  for (int i = 0; i < M; ++i) acc[i] = zacc[i] = _mm256_setzero_ps();
  const uint8_t* t = w.tiles + g * nb * tile;
  for (int64_t b = 0; b < nb; ++b, t += tile) {
    const uint8_t* chunks = t + code_at;
    __m256i dots[M][Halves];
    if constexpr (Bits == 4) {
      __m512i d512[M];
      for (int i = 0; i < M; ++i) d512[i] = _mm512_setzero_si512();
      for (int c = 0; c < 2; ++c) {
        const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
        const __m512i codes[4] = {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                                  _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble), _mm512_srli_epi16(v, 12)};
        for (int i = 0; i < M; ++i) {
          const int32_t* xs = spread.at(m0 + i, b);
          for (int k = 0; k < 4; ++k) d512[i] = _mm512_dpwssd_epi32(d512[i], codes[k], spread_at(xs, 4 * c + k));
        }
      }
      for (int i = 0; i < M; ++i) dots[i][0] = halves_added(d512[i]);
    } else {
      __m512i d512[M][Halves];
      for (int i = 0; i < M; ++i)
        for (int h = 0; h < Halves; ++h) d512[i][h] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {  // chunks 2c and 2c + 1: columns 16 (c / 2) .. in groups of 16
        const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
        const __m512i low = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), high = _mm512_srai_epi16(v, 8);
        const int h = Halves == 2 ? c / 2 : 0;
        for (int i = 0; i < M; ++i) {
          const int32_t* xs = spread.at(m0 + i, b);
          d512[i][h] = _mm512_dpwssd_epi32(d512[i][h], low, spread_at(xs, 2 * c));
          d512[i][h] = _mm512_dpwssd_epi32(d512[i][h], high, spread_at(xs, 2 * c + 1));
        }
      }
      for (int i = 0; i < M; ++i)
        for (int h = 0; h < Halves; ++h) dots[i][h] = halves_added(d512[i][h]);
    }
    scale_block<Halves, M>(x, w, t, m0, b, dots, acc, zacc);
  }
  store_group<M>(w, g, m0, acc, zacc, y);
}

template <int Bits, int Group>
RADIXLM_AVX512 void groups(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y) {
  thread_local Spread spread;  // one table a call, reused across the calls of this thread
  make_spread(x, Bits, spread);
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) group_rows<Bits, Group, 4>(x, spread, w, m, g, y);
    switch (x.rows - m) {
      case 3: group_rows<Bits, Group, 3>(x, spread, w, m, g, y); break;
      case 2: group_rows<Bits, Group, 2>(x, spread, w, m, g, y); break;
      case 1: group_rows<Bits, Group, 1>(x, spread, w, m, g, y); break;
      default: break;
    }
  }
}

}  // namespace

void matmul_groups_avx512(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y) {
  if (w.bits == 4)
    groups<4, 32>(x, w, g0, g1, y);
  else if (w.group == 16)
    groups<8, 16>(x, w, g0, g1, y);
  else
    groups<8, 32>(x, w, g0, g1, y);
}

}  // namespace radixlm
