// Shared by every kernel file: the ISA levels, the activation format the quantized matmuls read,
// and the per-ISA entry points each kernel file defines.
#pragma once

#include <cstdint>

namespace radixlm {

// The instruction sets a kernel may be built for, in the order of preference. Each vectorized
// path is tested against `portable`, which is the reference.
// avx512: F, BW, VL and VNNI (the matmuls; its other ops are the AVX2 ones).
enum class Isa : int64_t { portable = 0, avx2 = 1, avx512 = 2 };

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

// A weight matrix as integer codes in groups of 32 input columns, w = scale * code + zero, laid
// out once at load for the kernels (kernels/cpu/__init__.py `tile`): rows in groups of 8, and for
// each group its blocks of 32 columns in order, one tile each, so that a decode step reads every
// matrix as one sequential stream. A tile holds the 8 rows' scales (fp16 or fp32; for 8-bit
// codes in groups of 16, Q6_K's sub-blocks, two per row: the first 16 columns' 8, then the
// second's), their zero points where the matrix has them, then the codes in 32-byte chunks of
// 16 16-bit words, word i holding row i / 2's codes for the column pairs the chunk covers, column
// 2p + i % 2 of pair p:
//   4 bits: chunk j (0..3) covers pairs 4j..4j+3; pair 4j+k in bits 4k..4k+3 of each word;
//   8 bits: chunk j (0..7) covers pairs 2j (low byte) and 2j+1 (high byte), int8.
// So one shift and mask of a chunk gives a pair's codes as 16-bit lanes of 8 rows x 2 columns,
// and one multiply-add against the activations' pair sums all 8 rows at once.
constexpr int64_t kTileRows = 8;

struct TiledMatrix {
  const uint8_t* tiles;  // [groups, blocks, tile_bytes()]
  int64_t rows, cols;    // rows: the real outputs (the last group's padding rows are never stored)
  int bits;              // 4 (codes 0..15) or 8 (int8)
  int64_t group;         // columns per scale: 32, or 16 (8-bit codes without zero points)
  bool half, zero;       // scales (and zero points) in fp16, else fp32; zero points present
  int64_t blocks() const { return cols / kBlock; }
  int64_t groups() const { return (rows + kTileRows - 1) / kTileRows; }
  int64_t scale_bytes() const { return kTileRows * (kBlock / group) * (half ? 2 : 4); }
  int64_t zero_bytes() const { return zero ? kTileRows * (half ? 2 : 4) : 0; }
  int64_t code_bytes() const { return kTileRows * kBlock * bits / 8; }
  int64_t tile_bytes() const { return scale_bytes() + zero_bytes() + code_bytes(); }
};

// y[m, n] for the rows of groups [g0, g1) of w and every activation row m (y is [m, w.rows],
// row-major). Each output sums its blocks in order into one accumulator, whatever m, g0 and g1
// are: batch invariant, and every path bitwise the portable one.
void matmul_groups_portable(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y);
void matmul_groups_avx2(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y);
void matmul_groups_avx512(const QuantizedActivations& x, const TiledMatrix& w, int64_t g0, int64_t g1, float* y);

void quantize_rows_portable(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum);
void quantize_rows_avx2(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum);

// Rows `ids` of w dequantized, out [n, w.cols] = scale * code + zero in fp32 (a multiply, then an
// add): an embedding table's lookups, read from the tiles of those rows alone.
void dequantize_rows(const TiledMatrix& w, const int64_t* ids, int64_t n, float* out);

float half_to_float(uint16_t h);

}  // namespace radixlm
