// The weight formats the quantized matmuls read, and where each keeps its codes and scales.
//
// A served matrix is a GGUF file's own blocks laid out once at load (repack.cpp) in tiles of 8
// rows x 32 columns, so that a decode step reads each matrix as one sequential stream and a
// vector register holds 8 rows' codes for two columns. A matrix is one or more segments (runs of
// output rows), each in one format: a fused projection keeps each part's own format (Q4_K_M's q
// and k in Q4_K beside v in Q6_K). A segment is its rows in groups of 8 (the last one padded with
// zero rows); each group is its blocks of 32 columns in order, one tile each; the K formats put a
// header before every 8 tiles (their 256-column super-block's scales). Nothing is widened: every
// format is served at its file's size (Q4_K's 6-bit sub-scales as bytes: 2.8% over the file).
//
// A tile, for rows r = 0..7 of its group and columns c = 0..31 of its block:
//   scales   u4, s4, s8: scale[r] (fp16, or fp32 where `wide`), u4 then zero[r] likewise;
//            k4, k5: sc[r], m[r] (uint8, the 6-bit sub-block scale and min);
//            k6: sc[h][r] (int8; h = 0 for columns 0..15, 1 for 16..31); f4: e[r] (uint8 exponent)
//   codes    4-bit formats: 4 chunks of 32 bytes, chunk t's dword r = row r's block bytes
//            4t..4t+3, where block byte j holds column j's low 4 bits and, above them, column
//            j + 16's (GGUF's Q4_0 order); s8: 8 chunks, chunk t's dword r = row r's codes of
//            columns 4t..4t+3 (int8)
//   high     k5: a dword a row, bit q = the fifth bit of the first column of pair q (see below),
//            bit 16 + q of its second; k6: two dword planes of 8 rows, pair q's two bits in
//            plane q / 8 at bits 2 (q % 8) and 16 + 2 (q % 8)
// and the K formats' header: d[r] then (k4, k5) dmin[r], fp16.
//
// So a chunk's dword lane r, shifted and masked per 16-bit half, gives row r's codes of two
// columns (c, c + 2) as two 16-bit integers: one multiply-add against the activations' matching
// pair sums 8 rows at once. Pair q = 2u + e of a block is columns (4u + e, 4u + e + 2); the
// quantized activations are stored in that order (`pair_order`), so a pair is one 32-bit load.
// 4-bit chunk t shifted by 4k (k = 0..3) is pair 2t + {0, 8, 1, 9}[k]; s8 chunk t's low bytes
// pair 2t, its high bytes pair 2t + 1. Pairs 0..7 are columns 0..15 (Q6_K's first sub-block).
//
// The values: u4 w = scale code + zero (codes 0..15); s4 w = scale code (codes -8..7); s8 w =
// scale code; k4 w = (d sc) code - (dmin m), codes 0..15, k5 the same with codes 0..31; k6
// w = (d sc[h]) code, codes -32..31; f4 w = 2^(e - 128) code, codes twice an E2M1 value
// (-12..12). Each product in parentheses is exact in fp32.
#pragma once

#include <cstdint>
#include <vector>

namespace radixlm {

enum class Codes : int64_t { u4 = 0, s4 = 1, s8 = 2, k4 = 3, k5 = 4, k6 = 5, f4 = 6 };
constexpr int64_t kCodeKinds = 7;

constexpr int64_t kTileRows = 8;
constexpr int64_t kSuperBlocks = 8;  // tiles a K format's header covers (256 columns)

constexpr bool is_k(Codes k) { return k == Codes::k4 || k == Codes::k5 || k == Codes::k6; }
constexpr bool has_zero(Codes k) { return k == Codes::u4 || k == Codes::k4 || k == Codes::k5; }
constexpr int halves(Codes k) { return k == Codes::k6 ? 2 : 1; }

// Columns c and c' of a block swap places with pair order (bits 0 and 1 of c exchanged): the
// activations' layout, in which pair q is elements 2q and 2q + 1.
constexpr int64_t pair_order(int64_t c) { return (c & ~int64_t(3)) | ((c & 1) << 1) | ((c >> 1) & 1); }

// The bytes of a tile's parts, and of a K format's header.
struct Layout {
  int64_t scales = 0, zeros = 0, codes = 0, high = 0, header = 0;
  int64_t tile() const { return scales + zeros + codes + high; }
};

inline Layout layout_of(Codes kind, bool wide) {
  const int64_t value = (wide ? 4 : 2) * kTileRows;
  switch (kind) {
    case Codes::u4: return {value, value, 128, 0, 0};
    case Codes::s4: return {value, 0, 128, 0, 0};
    case Codes::s8: return {value, 0, 256, 0, 0};
    case Codes::k4: return {16, 0, 128, 0, 32};
    case Codes::k5: return {16, 0, 128, 32, 32};
    case Codes::k6: return {16, 0, 128, 64, 16};
    case Codes::f4: return {8, 0, 128, 0, 0};
  }
  return {};
}

// One segment: output rows [row0, row0 + rows) in one format, its tiles from byte `offset` of the
// matrix's buffer.
struct Segment {
  int64_t row0, rows, offset;
  Codes kind;
  bool wide;  // u4, s4, s8: scales (and zero points) fp32, else fp16
  int64_t groups() const { return (rows + kTileRows - 1) / kTileRows; }
};

// A segment's tiles as the kernels walk them.
struct TileStream {
  const uint8_t* base;  // the segment's first byte
  int64_t rows, blocks;
  Codes kind;
  bool wide;
  Layout layout;

  TileStream(const uint8_t* data, const Segment& s, int64_t cols)
      : base(data + s.offset), rows(s.rows), blocks(cols / 32), kind(s.kind), wide(s.wide),
        layout(layout_of(s.kind, s.wide)) {}
  int64_t groups() const { return (rows + kTileRows - 1) / kTileRows; }
  int64_t group_bytes() const { return blocks * layout.tile() + blocks / kSuperBlocks * layout.header; }
  const uint8_t* group(int64_t g) const { return base + g * group_bytes(); }
  // the header block b's tile reads (K formats), and the tile itself, within group bytes `gp`
  const uint8_t* header(const uint8_t* gp, int64_t b) const {
    return gp + b / kSuperBlocks * (layout.header + kSuperBlocks * layout.tile());
  }
  const uint8_t* tile(const uint8_t* gp, int64_t b) const {
    return header(gp, b) + layout.header + b % kSuperBlocks * layout.tile();
  }
};

// The bytes a segment of `rows` x `cols` takes in `kind`.
inline int64_t segment_bytes(Codes kind, bool wide, int64_t rows, int64_t cols) {
  const Layout l = layout_of(kind, wide);
  const int64_t blocks = cols / 32;
  return (rows + kTileRows - 1) / kTileRows * (blocks * l.tile() + blocks / kSuperBlocks * l.header);
}

// A matrix: its buffer and segments (in row order, covering rows [0, rows)).
struct TiledMatrix {
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0;
  std::vector<Segment> segments;
  int64_t blocks() const { return cols / 32; }
};

}  // namespace radixlm
