// GGUF blocks into the kernels' tiles (repack.cpp).
#pragma once

#include <cstdint>

#include "tiles.h"

namespace radixlm {

// The block formats a served matrix is read from: GGUF's, and two of them with fp32 scales for
// codes made at load (int4 and int8 requantized from dense weights).
enum class Source : int64_t { q4_0 = 0, q4_1 = 1, q8_0 = 2, q4_k = 3, q5_k = 4, q6_k = 5, mxfp4 = 6, q4_1_wide = 7,
                              q8_0_wide = 8 };
constexpr int64_t kSources = 9;

Codes source_codes(Source s, bool* wide);  // the tile format a source is served as
int64_t source_block_bytes(Source s);
int64_t source_block_cols(Source s);

// Tiles of n_rows x cols (segment_bytes of the source's format) into out, row r read from
// rows[r] (its first block; null: a row of zeros). Split over torch's threads by row group.
void repack_rows(Source s, const uint8_t* const* rows, int64_t n_rows, int64_t cols, uint8_t* out);

}  // namespace radixlm
