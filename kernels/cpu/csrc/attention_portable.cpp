// The portable path of rotary + K/V store and of paged decode attention: the reference for
// their vector paths (which match it to rounding: their exp is a polynomial).
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

}  // namespace

void rope_store_portable(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                         const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1) {
  const int64_t d = x.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    float* row = x.qkv + t * x.row_stride;
    const float* cos = cos2 + positions[t] * d;
    const float* sin = sin2 + positions[t] * d;
    for (int64_t h = 0; h < x.heads + x.kv_heads; ++h) rotate(row + h * d, cos, sin, d);
    const float* k = row + x.heads * d;
    const float* v = k + x.kv_heads * d;
    for (int64_t h = 0; h < x.kv_heads; ++h)
      for (int64_t i = 0; i < d; ++i) {
        kv.k[(h * kv.slots + out_slots[t]) * d + i] = k[h * d + i];
        kv.v[(h * kv.slots + out_slots[t]) * d + i] = v[h * d + i];
      }
  }
}

namespace {

// The softmax-weighted values of one query head, scores[0..len) (each key's, already scaled and
// capped) and their maximum `top` given; `sink` (no larger than top) one more term of the
// softmax's sum, with no value (-INFINITY: none).
void weigh_values(int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots, int64_t len,
                  float top, float* scores, float* out, float sink = -INFINITY) {
  const float* values = kv.v + kv_head * kv.slots * head_dim;
  float total = sink == -INFINITY ? 0.0f : std::exp(sink - top);
  for (int64_t j = 0; j < len; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  for (int64_t i = 0; i < head_dim; ++i) out[i] = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    const float* value = values + slots[j] * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) out[i] = std::fma(scores[j], value[i], out[i]);
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < head_dim; ++i) out[i] *= inv;
}

float dot(const float* q, const float* key, int64_t head_dim) {
  float sum = 0.0f;
  for (int64_t i = 0; i < head_dim; ++i) sum = std::fma(q[i], key[i], sum);
  return sum;
}

}  // namespace

void decode_head_special(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots,
                         int64_t len, float scale, float softcap, float sink, float* scores, float* out) {
  const float* keys = kv.k + kv_head * kv.slots * head_dim;
  float top = sink;
  for (int64_t j = 0; j < len; ++j) {
    const float s = dot(q, keys + slots[j] * head_dim, head_dim) * scale;
    scores[j] = softcap > 0 ? softcap * std::tanh(s / softcap) : s;
    top = max_score(top, scores[j]);
  }
  weigh_values(head_dim, kv, kv_head, slots, len, top, scores, out, sink);
}

void decode_head_portable(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head, const int64_t* slots,
                          int64_t len, float scale, float* scores, float* out) {
  const float* keys = kv.k + kv_head * kv.slots * head_dim;
  float top = -INFINITY;
  for (int64_t j = 0; j < len; ++j) {
    scores[j] = dot(q, keys + slots[j] * head_dim, head_dim) * scale;
    top = max_score(top, scores[j]);
  }
  weigh_values(head_dim, kv, kv_head, slots, len, top, scores, out);
}

}  // namespace radixlm
