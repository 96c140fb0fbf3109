// The AVX2 path of the fused elementwise ops. RMSNorm is bitwise the portable path (same lanes,
// same tree); SiLU uses a polynomial exp accurate to a few ulp, so it is tested to a tolerance.
#include "common.h"  // RADIXLM_X86: the vector paths are built on x86 only
#if RADIXLM_X86

#include <cmath>

#include "avx2.h"
#include "elementwise.h"

namespace radixlm {

RADIXLM_AVX2 void rms_norm_rows_avx2(const float* x, const float* weight, float eps, int64_t rows, int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < dim; ++i) ss = std::fma(xr[i], xr[i], ss);
    const float inv_s = 1.0f / std::sqrt(ss / float(dim) + eps);
    const __m256 inv = _mm256_set1_ps(inv_s);
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8)
      _mm256_storeu_ps(out + r * dim + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), inv), _mm256_loadu_ps(weight + j)));
    for (; j < dim; ++j) out[r * dim + j] = (xr[j] * inv_s) * weight[j];
  }
}

RADIXLM_AVX2 void silu_mul_rows_avx2(const float* gate_up, int64_t rows, int64_t inner, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    int64_t j = 0;
    for (; j + 8 <= inner; j += 8) {
      const __m256 gv = _mm256_loadu_ps(g + j);
      const __m256 e = exp_ps(_mm256_xor_ps(gv, sign_bit));
      _mm256_storeu_ps(out + r * inner + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
    for (; j < inner; ++j) out[r * inner + j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

}  // namespace radixlm

#endif  // RADIXLM_X86
