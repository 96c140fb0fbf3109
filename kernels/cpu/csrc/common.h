// Shared by every kernel file: the ISA levels, the activation format the quantized matmuls read,
// and the per-ISA entry points each kernel file defines.
#pragma once

#include <cstdint>

namespace radixlm {

// The instruction sets a kernel may be built for, in the order of preference. Each vectorized
// path is tested against `portable`, which is the reference.
enum class Isa : int64_t { portable = 0, avx2 = 1 };

Isa best_isa();                      // the best level this CPU runs (from cpuid, at first call)
Isa resolve_isa(int64_t requested);  // -1: best_isa(); else that level, checked against the CPU

constexpr int kBlock = 32;  // columns per activation block (one scale each)

// Activations quantized per block of 32 columns to 16 bits: x ~= d * q, d = max|x| / 32767, with
// `sum` = d * (sum of q), so a weight block's zero point multiplies the same activations its
// codes do. 16 bits, not 8: an int8 block cost SmolLM2 a point of top-1 agreement with fp32
// (benchmarks/README.md); at 16 the activations' rounding is below fp32's accumulation noise.
struct QuantizedActivations {
  const int16_t* q;  // [rows, cols]
  const float* d;    // [rows, cols / 32]
  const float* sum;  // [rows, cols / 32]
  int64_t rows, cols;
  int64_t blocks() const { return cols / kBlock; }
};

// A weight matrix as integer codes in groups of 32 input columns: w = scale * code + zero.
// 4-bit codes (0..15) are packed two a byte per group, byte j holding column j (low nibble) and
// column j + 16 (high nibble), GGUF's own order; 8-bit codes are int8, one a byte. 8-bit codes
// without zero points may have a scale per 16 columns instead (`group` 16: Q6_K's sub-blocks). scale and zero
// are [rows, cols / 32] in fp32 or fp16 (`half` set); zero may be null (none).
struct CodeMatrix {
  const uint8_t* codes;
  const void* scale;
  const void* zero;
  int64_t rows, cols;
  int bits;
  bool half;
  int64_t group;  // columns per scale: 32, or 16 (8-bit codes, no zero points)
  int64_t blocks() const { return cols / kBlock; }
  int64_t row_bytes() const { return cols * bits / 8; }
};

// y[m, n] for rows [n0, n1) of w and every activation row m (y is [m, w.rows], row-major). Each
// output is summed in one fixed order whatever m, n0 and n1 are: batch invariant.
void matmul_rows_portable(const QuantizedActivations& x, const CodeMatrix& w, int64_t n0, int64_t n1, float* y);
void matmul_rows_avx2(const QuantizedActivations& x, const CodeMatrix& w, int64_t n0, int64_t n1, float* y);

void quantize_rows_portable(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum);
void quantize_rows_avx2(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum);

float half_to_float(uint16_t h);

}  // namespace radixlm
