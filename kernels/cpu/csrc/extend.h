// Extend attention (prefill chunks): each new token of a row attends the row's keys up to its own
// position, read in place from the head-major pool through the token table. The vector paths
// are one blocked, online-softmax loop (extend_tile.h) built per ISA; the portable path is the
// decode kernel run once per (token, query head), and the reference for both. The same blocked
// loop also serves decode rows on one cached prompt outside --deterministic (dispatch.cpp).
#pragma once

#include <cstdint>

#include "attention.h"

namespace radixlm {

// The extend rows of a step: row r's extend_lens[r] new tokens sit at positions prefix_lens[r]..,
// their queries at q + (token_starts[r] + t) * q_stride, their keys at table[rows[r] * table_cols
// + position]. Token t sees positions 0..prefix + t (the last `window` of them where window > 0),
// scores capped to softcap * tanh(s / softcap) where softcap > 0, sinks[head] one more logit in
// each softmax where sinks is not null.
struct ExtendRows {
  const int64_t* table;
  int64_t table_cols;
  const int64_t* rows;
  const int64_t* prefix_lens;
  const int64_t* extend_lens;
  const int64_t* token_starts;
  int64_t n;
  int64_t window = 0;
  float softcap = 0.0f;
  const float* sinks = nullptr;
};

struct QueryLayout {  // query rows [tokens, heads * head_dim] in, and out, rows strided
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
  int64_t heads, kv_heads, head_dim;
  float scale;
};

// Consecutive tokens of one request as query rows of a blocked task: rows token .. token + tokens
// - 1 of q and out, at positions position.., their keys through its token-table row `slots`.
struct QuerySource {
  int64_t token, tokens, position;
  const int64_t* slots;
};

// The query heads of KV head `kv_head` for `n` sources whose keys [0, common) are the same slots
// (requests on one cached prompt; a lone source: every key it reads), attended by the blocked
// kernel: those keys a block at a time for every source's rows at once, then each source's own
// keys for its rows alone. Each token sees the keys up to its position (the last `window` of
// them where window > 0; then one source only); softcap and sinks as ExtendRows'.
struct BlockedTask {
  const QuerySource* sources;
  int64_t n, kv_head, common;
  int64_t window = 0;
  float softcap = 0.0f;
  const float* sinks = nullptr;
};

constexpr int64_t kExtendKeys = 64;  // keys a block of the blocked kernel

// The floats of scratch a task of `query_rows` rows (tokens x query heads of its KV head) needs
// (and beside them, one int64 position a row).
inline int64_t blocked_scratch_floats(int64_t query_rows, int64_t head_dim) {
  return query_rows * (2 * head_dim + kExtendKeys + 2) + kExtendKeys * head_dim;
}

// Whether the ISA's blocked kernel takes a head dimension (its vectors must tile it exactly).
inline bool blocked_avx2_takes(int64_t head_dim) { return head_dim % 8 == 0 && head_dim <= 512; }
inline bool blocked_avx512_takes(int64_t head_dim) { return head_dim % 16 == 0 && head_dim <= 512; }

void attend_sources_avx2(const QueryLayout& x, const KVLayer& kv, const BlockedTask& task, float* scratch,
                         int64_t* positions);
void attend_sources_avx512(const QueryLayout& x, const KVLayer& kv, const BlockedTask& task, float* scratch,
                           int64_t* positions);

}  // namespace radixlm
