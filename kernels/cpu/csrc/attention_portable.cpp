// The portable path of rotary + K/V store and of paged decode attention: the reference for
// their vector paths (which match it to rounding: their exp is a polynomial). Written once over
// the pool's element type (kv_types.h), each element converted as it is read.
#include <cmath>

#include "attention.h"

namespace radixlm {

namespace {

void rotate(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

template <class E>
void store_token(const TokenLayout& x, const float* row, const KVLayer& kv, int64_t slot) {
  const int64_t d = x.head_dim;
  const float* k = row + x.heads * d;
  const float* v = k + x.kv_heads * d;
  auto* keys = static_cast<typename E::T*>(kv.k);
  auto* values = static_cast<typename E::T*>(kv.v);
  for (int64_t h = 0; h < x.kv_heads; ++h) {
    store_row<E>(k + h * d, d, keys + (h * kv.slots + slot) * kv.row());
    store_row<E>(v + h * d, d, values + (h * kv.slots + slot) * kv.row());
  }
}

}  // namespace

void store_kv_portable(const TokenLayout& x, const float* row, const KVLayer& kv, int64_t slot) {
  switch (kv.type) {
    case KVType::f16: return store_token<F16>(x, row, kv, slot);
    case KVType::bf16: return store_token<BF16>(x, row, kv, slot);
    case KVType::i8: return store_token<I8>(x, row, kv, slot);
    default: return store_token<F32>(x, row, kv, slot);
  }
}

void rope_store_portable(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                         const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1) {
  const int64_t d = x.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    float* row = x.qkv + t * x.row_stride;
    const float* cos = cos2 + positions[t] * d;
    const float* sin = sin2 + positions[t] * d;
    for (int64_t h = 0; h < x.heads + x.kv_heads; ++h) rotate(row + h * d, cos, sin, d);
    store_kv_portable(x, row, kv, out_slots[t]);
  }
}

namespace {

// The softmax-weighted values of one query head, scores[0..len) (each key's, already scaled and
// capped) and their maximum `top` given; `sink` (no larger than top) one more term of the
// softmax's sum, with no value (-INFINITY: none).
template <class E>
void weigh_values(int64_t head_dim, const KVRows<E>& values, const int64_t* slots, int64_t len, float top,
                  float* scores, float* out, float sink) {
  float total = sink == -INFINITY ? 0.0f : std::exp(sink - top);
  for (int64_t j = 0; j < len; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  for (int64_t i = 0; i < head_dim; ++i) out[i] = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    const auto* value = values.at(slots[j]);
    const float p = values.value_weight(slots[j], scores[j]);
    for (int64_t i = 0; i < head_dim; ++i) out[i] = std::fma(p, E::load(value, i), out[i]);
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < head_dim; ++i) out[i] *= inv;
}

template <class E>
float dot(const float* q, const typename E::T* key, int64_t head_dim) {
  float sum = 0.0f;
  for (int64_t i = 0; i < head_dim; ++i) sum = std::fma(q[i], E::load(key, i), sum);
  return sum;
}

template <class E>
void decode_head(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots,
                 int64_t len, const Logits& logits, float* scores, float* out) {
  const KVRows<E> keys = kv.keys<E>(kv_head);
  const float sink = logits.sink(0);
  float top = sink;
  for (int64_t j = 0; j < len; ++j) {
    scores[j] = logits.cap(dot<E>(q, keys.at(slots[j]), head_dim) * keys.key_factor(slots[j], logits.scale));
    top = max_score(top, scores[j]);
  }
  weigh_values<E>(head_dim, kv.values<E>(kv_head), slots, len, top, scores, out, sink);
}

}  // namespace

void decode_head_portable(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots,
                          int64_t len, const Logits& logits, float* scores, float* out) {
  switch (kv.type) {
    case KVType::f16: return decode_head<F16>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case KVType::bf16: return decode_head<BF16>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case KVType::i8: return decode_head<I8>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    default: return decode_head<F32>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
  }
}

}  // namespace radixlm
