// Tensor checks shared by the torch ops (ops.cpp) and the decoder (decoder.cpp): each turns
// tensors into the kernels' views after checking shapes, dtypes and every index the kernels
// will follow, so a bad argument is a clear error and never a read or write out of bounds.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <type_traits>

#include "attention.h"
#include "common.h"
#include "dispatch.h"

namespace radixlm {

// An argument check's message, put together without std::ostream: numbers by std::to_string. On
// one machine (g++ 13.3, torch 2.11) formatting an integer through TORCH_CHECK's stream crashed in
// libstdc++'s number formatting instead of raising (benchmarks/README.md); text alone was fine.
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append(std::string& s, T v) { s += std::to_string(v); }

template <class... A>
std::string message(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

}  // namespace radixlm

// TORCH_CHECK with the message above (built only when the check fails)
#define RADIXLM_CHECK(cond, ...) TORCH_CHECK(cond, ::radixlm::message(__VA_ARGS__))

namespace radixlm {

void check_rows(const at::Tensor& x, const char* what);  // contiguous 2-D float32 on the CPU

// tiles (uint8, laid out as tiles.h says) and their segments (int64 [n, 5]: row0, rows, offset,
// kind, wide), every segment inside the tiles and the segments covering the rows in order
TiledMatrix tiled_matrix(const at::Tensor& tiles, const at::Tensor& segments, int64_t rows, int64_t cols);

// A layer's K and V pools as the kernels read them: contiguous CPU tensors [kv_heads, slots, row] of
// one type, float32, float16 or bfloat16 (row: head_dim) or int8 (row: head_dim codes, then the
// row's fp32 scale in 4 bytes: head_dim + 4; kv_types.h).
KVLayer kv_layer(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t kv_heads, int64_t head_dim);
int64_t pool_head_dim(const at::Tensor& pool);  // the head_dim its rows hold (0: not a pool)
void check_index(const at::Tensor& t, int64_t n, const char* what);

// positions inside the rotary tables, out_slots inside the pool
void check_positions(const at::Tensor& positions, const at::Tensor& out_slots, int64_t tokens, int64_t table_positions,
                     int64_t slots);

// n decode rows through the token table: each row's table row and length valid, each of its
// slots inside the pool
DecodeRows decode_rows(const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, int64_t slots);

}  // namespace radixlm
