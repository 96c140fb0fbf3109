// The portable path of the quantized matmul: plain C++, the reference every vectorized path is
// tested against. It forms the same integer lanes the vector paths do and adds them in the same
// order (blocks in order into eight lanes, then the lanes in a fixed tree), so the paths agree
// bit for bit: the build forbids a compiler's own fused multiply-adds (-ffp-contract=off).
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

float scale_at(const CodeMatrix& w, int64_t i) {
  return w.half ? half_to_float(static_cast<const uint16_t*>(w.scale)[i]) : static_cast<const float*>(w.scale)[i];
}

float zero_at(const CodeMatrix& w, int64_t i) {
  if (w.zero == nullptr) return 0.0f;
  return w.half ? half_to_float(static_cast<const uint16_t*>(w.zero)[i]) : static_cast<const float*>(w.zero)[i];
}

int32_t code_at(const CodeMatrix& w, const uint8_t* group, int column) {
  if (w.bits == 8) return int8_t(group[column]);
  const uint8_t byte = group[column % 16];
  return column < 16 ? (byte & 0x0F) : (byte >> 4);
}

// The integer lanes the vector paths form for one block: lane l sums columns 2l, 2l+1 (the
// first half's pairs) and 16+2l, 17+2l (the second half's).
void block_lanes(const CodeMatrix& w, const uint8_t* group, const int16_t* x, int32_t lanes[8]) {
  for (int l = 0; l < 8; ++l) {
    lanes[l] = 0;
    const int columns[4] = {2 * l, 2 * l + 1, 16 + 2 * l, 17 + 2 * l};
    for (int c : columns) lanes[l] += code_at(w, group, c) * int32_t(x[c]);
  }
}

// The vector paths' horizontal sum of eight lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the two.
float lanes_sum(const float acc[8]) {
  const float a0 = acc[0] + acc[4], a1 = acc[1] + acc[5], a2 = acc[2] + acc[6], a3 = acc[3] + acc[7];
  const float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

}  // namespace

void matmul_rows_portable(const QuantizedActivations& x, const CodeMatrix& w, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = w.blocks();
  const int64_t group_bytes = kBlock * w.bits / 8;
  for (int64_t m = 0; m < x.rows; ++m) {
    const int16_t* xq = x.q + m * x.cols;
    const float* xd = x.d + m * nb;
    const float* xs = x.sum + m * nb;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w.codes + n * w.row_bytes();
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        if (w.group == 16) {  // each half of the block its own scale: the halves' lanes apart
          for (int half = 0; half < 2; ++half) {
            const float s = scale_at(w, n * 2 * nb + 2 * b + half) * xd[b];
            for (int l = 0; l < 8; ++l) {
              const int c = 16 * half + 2 * l;
              const int32_t lane = code_at(w, row + b * group_bytes, c) * int32_t(xq[b * kBlock + c]) +
                                   code_at(w, row + b * group_bytes, c + 1) * int32_t(xq[b * kBlock + c + 1]);
              acc[l] = std::fma(float(lane), s, acc[l]);
            }
          }
          continue;
        }
        int32_t lanes[8];
        block_lanes(w, row + b * group_bytes, xq + b * kBlock, lanes);
        const float s = scale_at(w, n * nb + b) * xd[b];
        for (int l = 0; l < 8; ++l) acc[l] = std::fma(float(lanes[l]), s, acc[l]);
      }
      float zacc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t b = 0;
      if (w.zero != nullptr) {
        for (; b + 8 <= nb; b += 8)
          for (int l = 0; l < 8; ++l) zacc[l] = std::fma(zero_at(w, n * nb + b + l), xs[b + l], zacc[l]);
      }
      float out = lanes_sum(acc) + lanes_sum(zacc);
      if (w.zero != nullptr)
        for (; b < nb; ++b) out = std::fma(zero_at(w, n * nb + b), xs[b], out);
      y[m * w.rows + n] = out;
    }
  }
}

}  // namespace radixlm
