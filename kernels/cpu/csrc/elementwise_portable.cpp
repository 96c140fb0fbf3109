// The portable path of the fused elementwise ops: the reference for their vectorized paths.
#include <cmath>

#include "elementwise.h"

namespace radixlm {

void rms_norm_rows_portable(const float* x, const float* weight, float eps, int64_t rows, int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] = std::fma(xr[i + l], xr[i + l], acc[l]);
    float ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < dim; ++i) ss = std::fma(xr[i], xr[i], ss);
    const float inv = 1.0f / std::sqrt(ss / float(dim) + eps);
    for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = (xr[j] * inv) * weight[j];
  }
}

void silu_mul_rows_portable(const float* gate_up, int64_t rows, int64_t inner, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    for (int64_t j = 0; j < inner; ++j) out[r * inner + j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

}  // namespace radixlm
