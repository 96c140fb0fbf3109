// Whole ops on raw buffers: the path the CPU runs (chosen by `isa`) and the split of the work
// across torch's intra-op threads. The torch ops (ops.cpp) check their tensors and call these;
// the decoder (decoder.cpp) calls them for every layer of a decode step, so both run the same
// arithmetic in the same order: a step through the decoder is bitwise a step through the ops.
#pragma once

#include <cstdint>

#include "attention.h"
#include "common.h"
#include "extend.h"

namespace radixlm {

// Room for `rows` x `cols` activations quantized per block (quantize_into's output).
struct ActivationBuffer {
  int16_t* q;
  float* d;
  float* sum;
};

void quantize_into(const float* x, int64_t rows, int64_t cols, const ActivationBuffer& out, Isa isa);

// y [m, w.rows] = x [m, w.cols] W^T (+ bias where not null), x quantized into `scratch` first.
void matmul_into(const float* x, int64_t m, const TiledMatrix& w, const float* bias, const ActivationBuffer& scratch,
                 float* y, Isa isa);

// out = rms_norm(x) * weight over rows of `dim`; with `residual` (not null): residual += x first
// and the sum is normalized.
void rms_norm_into(const float* x, const float* weight, float eps, float* residual, int64_t rows, int64_t dim,
                   float* out, Isa isa);

// out [rows, inner] = silu(gate) * up of gate_up [rows, 2 inner]
void silu_mul_into(const float* gate_up, int64_t rows, int64_t inner, float* out, Isa isa);

void rope_store_tokens(const TokenLayout& x, int64_t tokens, const int64_t* positions, const float* cos2,
                       const float* sin2, const KVLayer& kv, const int64_t* out_slots, Isa isa);

// Attention of n decode rows: row r's query heads at q + r * q_stride, its keys at
// table[rows[r] * table_cols + j] for j < seq_lens[r] (the last `window` of them where window > 0:
// a sliding layer's); out [n, heads * head_dim]. softcap > 0: each score s becomes
// softcap * tanh(s / softcap) before the softmax (Gemma 2). sinks: [heads] logits, each one more
// term in its head's softmax with no value (gpt-oss), or null.
struct DecodeRows {
  const int64_t* table;
  int64_t table_cols;
  const int64_t* rows;
  const int64_t* seq_lens;
  int64_t n, longest;
  int64_t window = 0;
  float softcap = 0.0f;
  const float* sinks = nullptr;
  // false: rows on one cached prompt may take the blocked kernel (extend.h), faster with more
  // rows but each row's bits then depend on its set's; true (--deterministic): bitwise alone
  bool exact = true;
};
void decode_attention_into(const float* q, int64_t q_stride, int64_t heads, int64_t head_dim, const KVLayer& kv,
                           int64_t kv_heads, const DecodeRows& rows, float scale, float* out, Isa isa);

// Attention of the extend rows' new tokens (extend.h), into x.out. Vector paths: tasks of a row's
// tokens and one KV head's query heads, the costliest first, taken by the threads as they come
// free. Portable: the decode kernel once per (token, query head).
void extend_attention_into(const QueryLayout& x, const KVLayer& kv, const ExtendRows& rows, Isa isa);

}  // namespace radixlm
