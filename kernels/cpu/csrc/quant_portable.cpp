// The portable path of the quantized matmul: plain C++, the reference every vectorized path is
// tested against. Each output's blocks are exact integer dots, each scaled and added into one
// accumulator in block order (the zero points' terms into another), as the vector paths do, so
// the paths agree bit for bit: the build forbids a compiler's own fused multiply-adds
// (-ffp-contract=off).
#include <cmath>
#include <cstring>

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
      const float scale = amax / 32767.0f;
      const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      int32_t total = 0;
      for (int i = 0; i < kBlock; ++i) {
        const int32_t v = int32_t(std::nearbyint(xb[i] * inv));
        q[r * cols + b * kBlock + i] = int16_t(v);
        total += v;
      }
      d[r * nb + b] = scale;
      sum[r * nb + b] = scale * float(total);
    }
  }
}

namespace {

float value_at(const uint8_t* p, int64_t i, bool half) {
  if (half) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return half_to_float(h);
  }
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// One tile's codes as integers, codes[row][column] (the layout in common.h).
void tile_codes(const TiledMatrix& w, const uint8_t* chunks, int32_t codes[kTileRows][kBlock]) {
  for (int i = 0; i < 16; ++i) {
    const int r = i / 2, e = i % 2;
    if (w.bits == 4) {
      for (int j = 0; j < 4; ++j) {
        const uint32_t word = uint32_t(chunks[32 * j + 2 * i]) | (uint32_t(chunks[32 * j + 2 * i + 1]) << 8);
        for (int k = 0; k < 4; ++k) codes[r][2 * (4 * j + k) + e] = int32_t((word >> (4 * k)) & 15);
      }
    } else {
      for (int j = 0; j < 8; ++j)
        for (int h = 0; h < 2; ++h) codes[r][2 * (2 * j + h) + e] = int8_t(chunks[32 * j + 2 * i + h]);
    }
  }
}

int32_t dot(const int32_t* codes, const int16_t* x, int n) {
  int32_t total = 0;
  for (int c = 0; c < n; ++c) total += codes[c] * int32_t(x[c]);
  return total;
}

}  // namespace

void dequantize_rows(const TiledMatrix& w, const int64_t* ids, int64_t n, float* out) {
  const int64_t nb = w.blocks(), tile = w.tile_bytes();
  int32_t codes[kTileRows][kBlock];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ids[i] / kTileRows, r = ids[i] % kTileRows;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* t = w.tiles + (g * nb + b) * tile;
      tile_codes(w, t + w.scale_bytes() + w.zero_bytes(), codes);
      const float zero = w.zero ? value_at(t + w.scale_bytes(), r, w.half) : 0.0f;
      for (int c = 0; c < kBlock; ++c) {
        const float scale = value_at(t, (w.group == 16 ? c / 16 : 0) * kTileRows + r, w.half);
        const float v = float(codes[r][c]) * scale;
        out[i * w.cols + b * kBlock + c] = w.zero ? v + zero : v;
      }
    }
  }
}

void matmul_groups_portable(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y) {
  const int64_t nb = w.blocks(), tile = w.tile_bytes();
  int32_t codes[kTileRows][kBlock];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m = 0; m < x.rows; ++m) {
      const int16_t* xq = x.q + m * x.cols;
      float acc[kTileRows] = {}, zacc[kTileRows] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* t = w.tiles + (g * nb + b) * tile;
        tile_codes(w, t + w.scale_bytes() + w.zero_bytes(), codes);
        const float d = x.d[m * nb + b];
        for (int r = 0; r < kTileRows; ++r) {
          if (w.group == 16) {  // each half of the block its own scale, the first half's first
            for (int h = 0; h < 2; ++h) {
              const float sd = value_at(t, h * kTileRows + r, w.half) * d;
              acc[r] = std::fma(float(dot(codes[r] + 16 * h, xq + b * kBlock + 16 * h, 16)), sd, acc[r]);
            }
          } else {
            const float sd = value_at(t, r, w.half) * d;
            acc[r] = std::fma(float(dot(codes[r], xq + b * kBlock, kBlock)), sd, acc[r]);
          }
          if (w.zero) zacc[r] = std::fma(value_at(t + w.scale_bytes(), r, w.half), x.sum[m * nb + b], zacc[r]);
        }
      }
      for (int r = 0; r < kTileRows && g * kTileRows + r < w.rows; ++r)
        y[m * w.rows + g * kTileRows + r] = w.zero ? acc[r] + zacc[r] : acc[r];
    }
  }
}

}  // namespace radixlm
