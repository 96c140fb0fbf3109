// Shared by every kernel file: the ISA levels, the activation format the quantized matmuls read,
// and the per-ISA entry points each kernel file defines.
#pragma once

#include <cfloat>
#include <cstdint>

#include "tiles.h"

// The vector paths are x86's. Elsewhere their files compile to nothing, best_isa() is the portable
// path, and the code that picks a path names a vector function through RADIXLM_VECTOR: null
// there, and never called.
#if defined(__x86_64__) || defined(__i386__)
#define RADIXLM_X86 1
#define RADIXLM_VECTOR(f) (&f)
#else
#define RADIXLM_X86 0
#define RADIXLM_VECTOR(f) nullptr
#endif

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
// Each block's q is stored in pair order (tiles.h `pair_order`: columns 1 and 2 of every 4
// exchanged), so the two columns a weight lane pairs are one 32-bit load.
// A block's d = max|x| / 32767 and the inverse its codes are rounded with, 32767 / max|x|. Where
// that inverse is no finite float (max|x| 0, or below ~1e-34: subnormal values) the block is
// zeros, d 0 and every code 0, on every path: an infinite inverse would make its codes undefined.
struct BlockScale {
  float d, inv;
};
inline BlockScale block_scale(float amax) {
  const float inv = 32767.0f / amax;
  return inv <= FLT_MAX ? BlockScale{amax / 32767.0f, inv} : BlockScale{0.0f, 0.0f};
}

struct QuantizedActivations {
  const int16_t* q;  // [rows, cols], each block in pair order
  const float* d;    // [rows, cols / 32]
  const float* sum;  // [rows, cols / 32]
  int64_t rows, cols;
  int64_t blocks() const { return cols / kBlock; }
};

// A segment's outputs for its row groups [g0, g1) and every activation row m, into y[m * y_stride
// + n] for the segment's row n (y points at its first output column). Each output is summed over
// the blocks in order into one accumulator (a block with zero points adds the exact-as-fp32
// fma(dot, scale d, zero sum), one without adds fma(dot, scale d, acc) per sub-block), whatever m,
// g0 and g1 are: batch invariant, and every path bitwise the portable one.
void matmul_stream_portable(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                            int64_t y_stride);
void matmul_stream_avx2(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                        int64_t y_stride);
void matmul_stream_avx512(const QuantizedActivations& x, const TileStream& w, int64_t g0, int64_t g1, float* y,
                          int64_t y_stride);

void quantize_rows_portable(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum);
void quantize_rows_avx2(const float* x, int64_t rows, int64_t cols, int16_t* q, float* d, float* sum);

// Rows `ids` of w dequantized, out [n, w.cols] = scale * code + zero in fp32 (a multiply, then an
// add): an embedding table's lookups, read from the tiles of those rows alone. A row outside
// every segment is zeros.
void dequantize_rows(const TiledMatrix& w, const int64_t* ids, int64_t n, float* out);

// The codes and scales of tile (g, b) of a segment as integers and floats: codes[r][c] in
// column order, scale[h][r] (h: Q6_K's two sub-blocks, else only h = 0), zero[r] (zeros where
// the format has none). The portable path's reading of a tile, and the tests' (through repack's
// round trip).
void decode_tile(const TileStream& w, int64_t g, int64_t b, int32_t codes[kTileRows][kBlock], float scale[2][kTileRows],
                 float zero[kTileRows]);

float half_to_float(uint16_t h);

}  // namespace radixlm
