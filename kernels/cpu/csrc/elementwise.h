// The fused elementwise ops' per-ISA entry points (rows are independent: the caller splits them
// across threads).
#pragma once

#include <cstdint>

namespace radixlm {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. Sum of squares in 8 lanes, then a fixed tree.
void rms_norm_rows_portable(const float* x, const float* weight, float eps, int64_t rows, int64_t dim, float* out);
void rms_norm_rows_avx2(const float* x, const float* weight, float eps, int64_t rows, int64_t dim, float* out);

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, inner + j]
void silu_mul_rows_portable(const float* gate_up, int64_t rows, int64_t inner, float* out);
void silu_mul_rows_avx2(const float* gate_up, int64_t rows, int64_t inner, float* out);

}  // namespace radixlm
