// The portable path of the quantized matmul: plain C++, the reference every vectorized path is
// tested against. A tile is read back into integer codes and fp32 scales (`decode_tile`, the one
// reading of tiles.h's layout in scalar code); each output's blocks are exact integer dots, each
// scaled into one accumulator in block order as the vector paths do, so the paths agree bit for
// bit: the build forbids a compiler's own fused multiply-adds (-ffp-contract=off).
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"

namespace radixlm {

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  const uint32_t man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: renormalize
    uint32_t e = 113, m = man;
    while (!(m & 0x400)) {
      m <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void quantize_rows_portable(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum) {
  const int64_t nb = cols / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * cols + b * kBlock;
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
      const BlockScale scale = block_scale(amax);
      int32_t total = 0;
      for (int i = 0; i < kBlock; ++i) {
        const int32_t v = int32_t(std::nearbyint(xb[i] * scale.inv));
        q[r * cols + b * kBlock + pair_order(i)] = int16_t(v);
        total += v;
      }
      d[r * nb + b] = scale.d;
      sum[r * nb + b] = scale.d * float(total);
    }
  }
}

namespace {

uint16_t u16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

float value_at(const uint8_t* p, int64_t i, bool wide) {
  if (!wide) return half_to_float(u16_at(p + 2 * i));
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// 2^(e - 128), exactly (e = 0, 1: subnormal)
float e8m0_half(uint8_t e) { return std::ldexp(1.0f, int(e) - 128); }

// The first and second column of pair q of a block (tiles.h).
int pair_column(int q, int second) { return 4 * (q / 2) + q % 2 + 2 * second; }

}  // namespace

void decode_tile(const TileStream& w, int64_t g, int64_t b, int32_t codes[kTileRows][kBlock], float scale[2][kTileRows],
                 float zero[kTileRows]) {
  const uint8_t* gp = w.group(g);
  const uint8_t* t = w.tile(gp, b);
  const uint8_t* head = w.header(gp, b);
  const Layout& l = w.layout;
  const uint8_t* chunks = t + l.scales + l.zeros;
  const uint8_t* high = chunks + l.codes;
  for (int r = 0; r < kTileRows; ++r) {
    zero[r] = 0.0f;
    scale[1][r] = 0.0f;
    switch (w.kind) {
      case Codes::u4:
        zero[r] = value_at(t + l.scales, r, w.wide);
        [[fallthrough]];
      case Codes::s4:
      case Codes::s8:
        scale[0][r] = value_at(t, r, w.wide);
        break;
      case Codes::k4:
      case Codes::k5: {
        const float d = half_to_float(u16_at(head + 2 * r)), dmin = half_to_float(u16_at(head + 16 + 2 * r));
        scale[0][r] = d * float(t[r]);
        zero[r] = -(dmin * float(t[8 + r]));
        break;
      }
      case Codes::k6: {
        const float d = half_to_float(u16_at(head + 2 * r));
        for (int h = 0; h < 2; ++h) scale[h][r] = d * float(int8_t(t[h * kTileRows + r]));
        break;
      }
      case Codes::f4:
        scale[0][r] = e8m0_half(t[r]);
        break;
    }
    if (w.kind == Codes::s8) {
      for (int c = 0; c < kBlock; ++c) codes[r][c] = int8_t(chunks[32 * (c / 4) + 4 * r + c % 4]);
      continue;
    }
    for (int j = 0; j < 16; ++j) {  // block byte j: column j's low bits, then column j + 16's
      const uint8_t byte = chunks[32 * (j / 4) + 4 * r + j % 4];
      codes[r][j] = byte & 15;
      codes[r][j + 16] = byte >> 4;
    }
    if (w.kind == Codes::k5) {
      const uint32_t bits = u32_at(high + 4 * r);
      for (int q = 0; q < 16; ++q)
        for (int second = 0; second < 2; ++second)
          codes[r][pair_column(q, second)] |= int32_t((bits >> (16 * second + q)) & 1) << 4;
    } else if (w.kind == Codes::k6) {
      for (int q = 0; q < 16; ++q) {
        const uint32_t bits = u32_at(high + 32 * (q / 8) + 4 * r);
        for (int second = 0; second < 2; ++second)
          codes[r][pair_column(q, second)] |= int32_t((bits >> (16 * second + 2 * (q % 8))) & 3) << 4;
      }
    }
    static constexpr int8_t kE2M1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    for (int c = 0; c < kBlock; ++c) {
      if (w.kind == Codes::s4) codes[r][c] -= 8;
      if (w.kind == Codes::k6) codes[r][c] -= 32;
      if (w.kind == Codes::f4) codes[r][c] = kE2M1Twice[codes[r][c]];
    }
  }
}

void dequantize_rows(const TiledMatrix& w, const int64_t* ids, int64_t n, float* out) {
  const int64_t nb = w.blocks();
  int32_t codes[kTileRows][kBlock];
  float scale[2][kTileRows], zero[kTileRows];
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + i * w.cols;
    std::memset(dst, 0, sizeof(float) * w.cols);
    for (const Segment& s : w.segments) {
      if (ids[i] < s.row0 || ids[i] >= s.row0 + s.rows) continue;
      const TileStream ts(w.data, s, w.cols);
      const int64_t g = (ids[i] - s.row0) / kTileRows, r = (ids[i] - s.row0) % kTileRows;
      const bool zeroed = has_zero(s.kind);
      for (int64_t b = 0; b < nb; ++b) {
        decode_tile(ts, g, b, codes, scale, zero);
        for (int c = 0; c < kBlock; ++c) {
          const float v = float(codes[r][c]) * scale[c / 16 * (halves(s.kind) - 1)][r];
          dst[b * kBlock + c] = zeroed ? v + zero[r] : v;
        }
      }
    }
  }
}

void matmul_stream_portable(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                            int64_t y_stride) {
  const int64_t nb = w.blocks;
  const bool zeroed = has_zero(w.kind);
  const int split = halves(w.kind) == 2 ? 16 : kBlock;
  int32_t codes[kTileRows][kBlock];
  float scale[2][kTileRows], zero[kTileRows];
  std::vector<float> acc(x.rows * kTileRows);
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      decode_tile(w, g, b, codes, scale, zero);
      for (int64_t m = 0; m < x.rows; ++m) {
        const int16_t* xq = x.q + m * x.cols + b * kBlock;
        const float d = x.d[m * nb + b];
        for (int r = 0; r < kTileRows; ++r) {
          int32_t dots[2] = {0, 0};
          for (int c = 0; c < kBlock; ++c) dots[c / split] += codes[r][c] * int32_t(xq[pair_order(c)]);
          float& a = acc[m * kTileRows + r];
          if (zeroed) {  // the block's code and zero-point terms in one fused multiply-add, then added
            a = a + std::fma(float(dots[0]), scale[0][r] * d, zero[r] * x.sum[m * nb + b]);
          } else {
            for (int h = 0; h < kBlock / split; ++h) a = std::fma(float(dots[h]), scale[h][r] * d, a);
          }
        }
      }
    }
    for (int64_t m = 0; m < x.rows; ++m)
      for (int r = 0; r < kTileRows && g * kTileRows + r < w.rows; ++r)
        y[m * y_stride + g * kTileRows + r] = acc[m * kTileRows + r];
  }
}

}  // namespace radixlm
