// Rotary with the K/V store, and paged decode attention: per-ISA entry points. The KV pool is
// head-major, [kv_heads, slots, row] per layer (a row: head_dim elements of the pool's type, and an
// int8 row's scale: kv_types.h); a request's keys are found through its row of the token table
// (position -> slot), read in place and converted to fp32 as they are loaded.
#pragma once

#include <cmath>
#include <cstdint>

#include "kv_types.h"

namespace radixlm {

struct TokenLayout {  // a step's qkv rows: [tokens, (heads + 2 kv_heads) * head_dim], q then k then v
  float* qkv;
  int64_t row_stride, heads, kv_heads, head_dim;
};

struct KVLayer {
  void* k;
  void* v;
  int64_t slots;  // the pool's slots per head
  int64_t head_dim;
  KVType type = KVType::f32;
  int64_t row() const { return kv_row(type, head_dim); }
  template <class E>
  KVRows<E> keys(int64_t kv_head) const {
    return {static_cast<const typename E::T*>(k) + kv_head * slots * row(), row(), head_dim};
  }
  template <class E>
  KVRows<E> values(int64_t kv_head) const {
    return {static_cast<const typename E::T*>(v) + kv_head * slots * row(), row(), head_dim};
  }
};

// Rotate token t's q and k heads in place ("rotate half": dimension i pairs with i + d/2, the
// full-width tables hold each frequency twice) at its position, then write its k and v to the
// pool at out_slots[t], converted to the pool's type (kv_types.h: store_row, bit for bit on
// every path).
void rope_store_portable(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                         const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1);
void rope_store_avx2(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                     const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1);
// The store alone: one token's k and v heads (after its q heads in `row`) into slot `slot`.
void store_kv_portable(const TokenLayout& x, const float* row, const KVLayer& kv, int64_t slot);

// The running maximum of a head's scores (a compare and a select, inlined: std::fmax is a call
// into libm in a build without -ffast-math, which cost ~10% of decode attention).
inline float max_score(float top, float s) { return s > top ? s : top; }

// How a head's scores become its softmax's logits: the dot products times `scale`, capped to
// softcap * tanh(s / softcap) where softcap > 0 (Gemma 2), and where `sinks` is not null one more
// logit in each softmax's sum with no value (gpt-oss): sinks[g] is the call's query head g's.
struct Logits {
  float scale;
  float softcap = 0.0f;
  const float* sinks = nullptr;
  float cap(float s) const { return softcap > 0 ? softcap * std::tanh(s / softcap) : s; }
  float sink(int64_t g) const { return sinks != nullptr ? sinks[g] : -INFINITY; }  // -inf: none
};

// One query head's attention over keys at `slots[0..len)` of KV head `kv_head`: scores, then max,
// exp and their sum, then the values weighted, each in key order: the same order whatever the
// batch. out: [head_dim]; scores: room for len floats.
void decode_head_portable(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots,
                          int64_t len, const Logits& logits, float* scores, float* out);
void decode_head_avx2(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots,
                      int64_t len, const Logits& logits, float* scores, float* out);

// The same for `heads` query heads that share KV head `kv_head` (query g at q + g * head_dim, its
// output at out + g * head_dim, its scores at scores + g * len), each key and value read once for
// all of them; bitwise decode_head_avx2 on each head. Only where decode_group_takes says so.
inline bool decode_group_takes(int64_t heads, int64_t head_dim) {
  return heads >= 1 && heads <= 8 && head_dim % 8 == 0 && head_dim <= 256;
}
void decode_group_avx2(const float* q, int64_t heads, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                       const int64_t* slots, int64_t len, const Logits& logits, float* scores, float* out);

// Decode rows whose first `shared` keys are the same slots (requests on one cached prompt): row r's
// query heads of one KV head at q[r], its keys at slots[r][0..lens[r]), its output at out[r].
struct SharedRows {
  const float* const* q;
  const int64_t* const* slots;
  const int64_t* lens;
  float* const* out;
  int64_t n, shared;
};
// decode_group_avx2 on each row of `set`, the shared keys and values read once for all of them a
// block at a time (not once per row): bitwise each row's decode_group_avx2. scratch: room for
// heads x (sum of lens + n x head_dim) floats.
void decode_shared_avx2(const SharedRows& set, int64_t heads, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                        const Logits& logits, float* scratch);

}  // namespace radixlm
