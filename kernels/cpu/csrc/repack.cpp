// A GGUF file's blocks laid out as the kernels' tiles (tiles.h), read once at load straight from
// the mapped file: no float32 copy of a matrix is ever made. Each source row is a pointer to its
// first block (so a tensor-parallel rank's slice, llama.cpp's q/k row permutation undone and a
// fused projection's parts are all just which rows are pointed at), or null for a zero row.
//
// The tiles keep each format's own bytes (tiles.h), so laying a block out is mostly a transpose:
// 8 rows' 4-byte groups of codes into chunks of one group for every row. At a model's size (4 GB
// for an 8B) this is the start-up's cost after reading the file, so it is done 16 bytes at a time
// with SSE2 (every x86-64 CPU), plain C++ elsewhere.
#include "repack.h"

#include <ATen/Parallel.h>

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace radixlm {

namespace {

struct SourceFormat {
  int64_t block_bytes, block_cols;
  Codes kind;
  bool wide;
};

SourceFormat source_format(Source s) {
  switch (s) {
    case Source::q4_0: return {18, 32, Codes::s4, false};
    case Source::q4_1: return {20, 32, Codes::u4, false};
    case Source::q8_0: return {34, 32, Codes::s8, false};
    case Source::q4_k: return {144, 256, Codes::k4, false};
    case Source::q5_k: return {176, 256, Codes::k5, false};
    case Source::q6_k: return {210, 256, Codes::k6, false};
    case Source::mxfp4: return {17, 32, Codes::f4, false};
    case Source::q4_1_wide: return {24, 32, Codes::u4, true};
    case Source::q8_0_wide: return {36, 32, Codes::s8, true};
  }
  return {};
}

constexpr int64_t kLargestBlock = 210;
alignas(16) const uint8_t kZeroBlock[kLargestBlock] = {};  // a zero row's every block

// out[32 t + 4 r .. + 4] = rows[r][4 t .. + 4] for t < n / 4: each row's n bytes of codes as
// n / 4 chunks of 4-byte groups, a group per row (n = 16: 4-bit codes, 32: 8-bit).
inline void transpose_groups(const uint8_t* const (&rows)[kTileRows], int n, uint8_t* out) {
#if defined(__SSE2__)
  for (int half = 0; half < 2; ++half) {  // rows 0..3, then 4..7: a 4 x 4 transpose of 32-bit groups
    for (int at = 0; at < n; at += 16) {
      __m128i a[4];
      for (int r = 0; r < 4; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * half + r] + at));
      const __m128i t0 = _mm_unpacklo_epi32(a[0], a[1]), t1 = _mm_unpackhi_epi32(a[0], a[1]);
      const __m128i t2 = _mm_unpacklo_epi32(a[2], a[3]), t3 = _mm_unpackhi_epi32(a[2], a[3]);
      const __m128i c[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2), _mm_unpacklo_epi64(t1, t3),
                            _mm_unpackhi_epi64(t1, t3)};
      for (int t = 0; t < 4; ++t)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * (at / 4 + t) + 16 * half), c[t]);
    }
  }
#else
  for (int r = 0; r < kTileRows; ++r)
    for (int t = 0; t < n / 4; ++t) std::memcpy(out + 32 * t + 4 * r, rows[r] + 4 * t, 4);
#endif
}

// Q4_K's (and Q5_K's) 32 bytes of nibbles for sub-blocks 2c and 2c + 1, byte i holding column i
// of the first (low nibble) and of the second (high): sub-block `second`'s 16 bytes in Q4_0's
// order (byte j: column j, then column j + 16). Q6_K's low nibbles are laid out the same way.
inline void k_nibbles(const uint8_t* qs, int second, uint8_t* out) {
#if defined(__SSE2__)
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
  const __m128i low4 = _mm_set1_epi8(0x0F), high4 = _mm_set1_epi8(char(0xF0));
  const __m128i v = second ? _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), low4), _mm_and_si128(hi, high4))
                           : _mm_or_si128(_mm_and_si128(lo, low4), _mm_slli_epi16(_mm_and_si128(hi, low4), 4));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), v);
#else
  for (int j = 0; j < 16; ++j)
    out[j] = second ? uint8_t((qs[j] >> 4) | (qs[j + 16] & 0xF0)) : uint8_t((qs[j] & 0x0F) | (qs[j + 16] << 4));
#endif
}

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j from the super-block's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Bits b, b + 1 of each group of 4 in v, gathered in order into 16 bits (v's bits 0, 1, 4, 5, 8, ...)
inline uint32_t gather_pairs(uint32_t v) {
  v &= 0x33333333u;
  v = (v | (v >> 2)) & 0x0F0F0F0Fu;
  v = (v | (v >> 4)) & 0x00FF00FFu;
  return (v | (v >> 8)) & 0x0000FFFFu;
}

// Q5_K's fifth bits of one row's sub-block j (bit j of qh[c] is column c's) as the tile's dword:
// bit q the first column of pair q (columns 0, 1, 4, 5, ...), bit 16 + q its second.
inline uint32_t k5_high(const uint8_t* qh, int j) {
#if defined(__SSE2__)  // bit j of each byte to bit 7, then the bytes' top bits
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16));
  const __m128i up = _mm_cvtsi32_si128(7 - j);
  const uint32_t mask = uint32_t(_mm_movemask_epi8(_mm_sll_epi16(lo, up))) |
                        (uint32_t(_mm_movemask_epi8(_mm_sll_epi16(hi, up))) << 16);
#else
  uint32_t mask = 0;
  for (int c = 0; c < 32; ++c) mask |= uint32_t((qh[c] >> j) & 1) << c;
#endif
  return gather_pairs(mask) | (gather_pairs(mask >> 2) << 16);
}

// Q6_K's two high bits of columns 8i .. 8i + 7 (bytes of a row's qh, each shifted by `shift`) as
// two bytes: the pairs' first columns (8i, 8i + 1, 8i + 4, 8i + 5) and their seconds.
inline void k6_high8(const uint8_t* qh, int shift, uint32_t* first, uint32_t* second) {
  uint64_t x;
  std::memcpy(&x, qh, 8);
  x = (x >> shift) & 0x0303030303030303ull;
  x |= x >> 6;  // byte 2i: column 2i's bits, then 2i + 1's
  *first = uint32_t((x & 0x0F) | ((x >> 28) & 0xF0));
  *second = uint32_t(((x >> 16) & 0x0F) | ((x >> 44) & 0xF0));
}

// The tile's two dword planes of one row's Q6_K sub-block (high bits qh[0..31] >> shift).
inline void k6_high(const uint8_t* qh, int shift, uint32_t* planes) {
  for (int p = 0; p < 2; ++p) {
    uint32_t f0, s0, f1, s1;
    k6_high8(qh + 16 * p, shift, &f0, &s0);
    k6_high8(qh + 16 * p + 8, shift, &f1, &s1);
    planes[p] = f0 | (f1 << 8) | (s0 << 16) | (s1 << 24);
  }
}

template <Source S>
void repack_group(const uint8_t* const (&rows)[kTileRows], const TileStream& ts, uint8_t* gp) {
  constexpr bool k_quant = S == Source::q4_k || S == Source::q5_k || S == Source::q6_k;
  const SourceFormat f = source_format(S);
  const Layout& l = ts.layout;
  const int value = f.wide ? 4 : 2;
  uint8_t* p = gp;
  for (int64_t b = 0; b < ts.blocks; ++b) {
    const int64_t at = (k_quant ? b / 8 : b) * f.block_bytes;  // the block (K: super-block) of column 32 b
    const uint8_t* src[kTileRows];
    for (int r = 0; r < kTileRows; ++r) src[r] = rows[r] ? rows[r] + at : kZeroBlock;
    if (k_quant && b % kSuperBlocks == 0) {  // the super-block's d (and dmin), fp16
      for (int r = 0; r < kTileRows; ++r) {
        std::memcpy(p + 2 * r, src[r] + (S == Source::q6_k ? 208 : 0), 2);
        if (S != Source::q6_k) std::memcpy(p + 16 + 2 * r, src[r] + 2, 2);
      }
      p += l.header;
    }
    uint8_t* t = p;
    p += l.tile();
    uint8_t* chunks = t + l.scales + l.zeros;
    const int j = int(b % 8);
    alignas(16) uint8_t staged[kTileRows][16];
    const uint8_t* codes[kTileRows];
    for (int r = 0; r < kTileRows; ++r) {
      const uint8_t* s = src[r];
      switch (S) {
        case Source::q4_0:
        case Source::q8_0:
        case Source::q8_0_wide:
          std::memcpy(t + value * r, s, value);
          codes[r] = s + value;
          break;
        case Source::q4_1:
        case Source::q4_1_wide:
          std::memcpy(t + value * r, s, value);
          std::memcpy(t + l.scales + value * r, s + value, value);
          codes[r] = s + 2 * value;
          break;
        case Source::mxfp4:
          t[r] = s[0];
          codes[r] = s + 1;
          break;
        case Source::q4_k:
        case Source::q5_k: {
          scale_min_k4(j, s + 4, t + r, t + 8 + r);
          k_nibbles(s + (S == Source::q4_k ? 16 : 48) + 32 * (j / 2), j % 2, staged[r]);
          codes[r] = staged[r];
          if (S == Source::q5_k) {
            const uint32_t bits = k5_high(s + 16, j);
            std::memcpy(chunks + l.codes + 4 * r, &bits, 4);
          }
          break;
        }
        case Source::q6_k: {
          const int n = j / 4, k = j % 4;
          t[r] = s[192 + 2 * j];
          t[8 + r] = s[192 + 2 * j + 1];
          k_nibbles(s + 64 * n + 32 * (k % 2), k / 2, staged[r]);  // ql's low (k < 2) or high nibbles
          codes[r] = staged[r];
          uint32_t planes[2];
          k6_high(s + 128 + 32 * n, 2 * k, planes);
          std::memcpy(chunks + l.codes + 4 * r, &planes[0], 4);
          std::memcpy(chunks + l.codes + 32 + 4 * r, &planes[1], 4);
          break;
        }
      }
    }
    transpose_groups(codes, S == Source::q8_0 || S == Source::q8_0_wide ? 32 : 16, chunks);
  }
}

template <Source S>
void repack_all(const uint8_t* const* rows, int64_t n_rows, const TileStream& ts) {
  at::parallel_for(0, ts.groups(), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* group[kTileRows];
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t row = g * kTileRows + r;
        group[r] = row < n_rows ? rows[row] : nullptr;
      }
      repack_group<S>(group, ts, const_cast<uint8_t*>(ts.group(g)));
    }
  });
}

}  // namespace

Codes source_codes(Source s, bool* wide) {
  const SourceFormat f = source_format(s);
  *wide = f.wide;
  return f.kind;
}

int64_t source_block_bytes(Source s) { return source_format(s).block_bytes; }
int64_t source_block_cols(Source s) { return source_format(s).block_cols; }

void repack_rows(Source s, const uint8_t* const* rows, int64_t n_rows, int64_t cols, uint8_t* out) {
  const SourceFormat f = source_format(s);
  const TileStream ts(out, Segment{0, n_rows, 0, f.kind, f.wide}, cols);
  switch (s) {
    case Source::q4_0: return repack_all<Source::q4_0>(rows, n_rows, ts);
    case Source::q4_1: return repack_all<Source::q4_1>(rows, n_rows, ts);
    case Source::q8_0: return repack_all<Source::q8_0>(rows, n_rows, ts);
    case Source::q4_k: return repack_all<Source::q4_k>(rows, n_rows, ts);
    case Source::q5_k: return repack_all<Source::q5_k>(rows, n_rows, ts);
    case Source::q6_k: return repack_all<Source::q6_k>(rows, n_rows, ts);
    case Source::mxfp4: return repack_all<Source::mxfp4>(rows, n_rows, ts);
    case Source::q4_1_wide: return repack_all<Source::q4_1_wide>(rows, n_rows, ts);
    case Source::q8_0_wide: return repack_all<Source::q8_0_wide>(rows, n_rows, ts);
  }
}

}  // namespace radixlm
