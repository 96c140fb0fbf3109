// Extend attention (prefill chunks): each new token of a row attends the row's keys up to its own
// position, read in place from the head-major pool through the token table. The vector paths
// are one blocked, online-softmax loop (extend_tile.h) built per ISA; the portable path is the
// decode kernel run once per (token, query head), and the reference for both.
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

struct ExtendQueries {  // [tokens, heads * head_dim] in and out, rows strided
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
  int64_t heads, kv_heads, head_dim;
  float scale;
};

// One task: tokens [t0, t1) of extend row `row`, the query heads of KV head `kv_head`.
struct ExtendTask {
  int64_t row, kv_head, t0, t1;
};

constexpr int64_t kExtendKeys = 64;  // keys a block of the vector paths

// Floats of scratch a task of `query_rows` (tokens x query heads of its KV head) needs.
inline int64_t extend_scratch_floats(int64_t query_rows, int64_t head_dim) {
  return query_rows * (2 * head_dim + kExtendKeys + 2) + kExtendKeys * head_dim;
}

// Whether the ISA's blocked kernel takes a head dimension (its vectors must tile it exactly).
inline bool extend_avx2_takes(int64_t head_dim) { return head_dim % 8 == 0 && head_dim <= 512; }
inline bool extend_avx512_takes(int64_t head_dim) { return head_dim % 16 == 0 && head_dim <= 512; }

void extend_task_avx2(const ExtendQueries& x, const KVLayer& kv, const ExtendRows& rows, const ExtendTask& task,
                      float* scratch);
void extend_task_avx512(const ExtendQueries& x, const KVLayer& kv, const ExtendRows& rows, const ExtendTask& task,
                        float* scratch);

}  // namespace radixlm
