// The AVX2 path of rotary + K/V store and of paged decode attention (head_dim a multiple of 8;
// others take the portable path).
#include <algorithm>
#include <cmath>
#include <vector>

#include "avx2.h"
#include "attention.h"

namespace radixlm {
namespace {

RADIXLM_AVX2 void rotate(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + half);
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)), _mm256_mul_ps(b, _mm256_loadu_ps(sin + i))));
    _mm256_storeu_ps(x + i + half, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + i + half)),
                                                 _mm256_mul_ps(a, _mm256_loadu_ps(sin + i + half))));
  }
}

}  // namespace

RADIXLM_AVX2 void rope_store_avx2(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                                  const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1) {
  const int64_t d = x.head_dim;
  if (d % 16) return rope_store_portable(x, positions, cos2, sin2, kv, out_slots, t0, t1);
  for (int64_t t = t0; t < t1; ++t) {
    float* row = x.qkv + t * x.row_stride;
    const float* cos = cos2 + positions[t] * d;
    const float* sin = sin2 + positions[t] * d;
    for (int64_t h = 0; h < x.heads + x.kv_heads; ++h) rotate(row + h * d, cos, sin, d);
    const float* k = row + x.heads * d;
    const float* v = k + x.kv_heads * d;
    for (int64_t h = 0; h < x.kv_heads; ++h)
      for (int64_t i = 0; i < d; i += 8) {
        _mm256_storeu_ps(kv.k + (h * kv.slots + out_slots[t]) * d + i, _mm256_loadu_ps(k + h * d + i));
        _mm256_storeu_ps(kv.v + (h * kv.slots + out_slots[t]) * d + i, _mm256_loadu_ps(v + h * d + i));
      }
  }
}

RADIXLM_AVX2 void decode_head_avx2(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                                   const int64_t* slots, int64_t len, float scale, float* scores, float* out) {
  constexpr int64_t kMaxChunks = 32;  // head_dim up to 256
  if (head_dim % 8 || head_dim / 8 > kMaxChunks) return decode_head_portable(q, head_dim, kv, kv_head, slots, len, scale, scores, out);
  const float* keys = kv.k + kv_head * kv.slots * head_dim;
  const float* values = kv.v + kv_head * kv.slots * head_dim;
  float top = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {  // four keys at a time: four independent chains of multiply-adds
    const float* key[4] = {keys + slots[j] * head_dim, keys + slots[j + 1] * head_dim, keys + slots[j + 2] * head_dim,
                           keys + slots[j + 3] * head_dim};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < head_dim; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int u = 0; u < 4; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[u] + i), acc[u]);
    }
    for (int u = 0; u < 4; ++u) {
      scores[j + u] = hsum(acc[u]) * scale;
      top = max_score(top, scores[j + u]);
    }
  }
  for (; j < len; ++j) {  // the same sums, one key at a time
    const float* key = keys + slots[j] * head_dim;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < head_dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(key + i), acc);
    scores[j] = hsum(acc) * scale;
    top = max_score(top, scores[j]);
  }
  const __m256 topv = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j), topv));
    _mm256_storeu_ps(scores + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; j < len; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  __m256 acc[kMaxChunks];
  const int64_t chunks = head_dim / 8;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < len; ++k) {  // each value row read once, whole
    const __m256 p = _mm256_set1_ps(scores[k]);
    const float* value = values + slots[k] * head_dim;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * c), acc[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

namespace {

// Dimensions 8 c0 .. 8 (c0 + W) of G heads' weighted values over keys [k0, k1), into acc: each
// key's value chunk read once, weighted for the G heads (each accumulator sums over the keys in
// key order, as decode_head_avx2's).
template <int G, int W>
RADIXLM_AVX2 __attribute__((always_inline)) inline void accumulate(__m256 (&acc)[G][W], const float* values,
                                                                  int64_t head_dim, const int64_t* slots, int64_t k0,
                                                                  int64_t k1, const float* scores, int64_t len,
                                                                  int64_t c0) {
  for (int64_t k = k0; k < k1; ++k) {
    const float* value = values + slots[k] * head_dim + 8 * c0;
    __m256 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(scores[g * len + k]);
    for (int c = 0; c < W; ++c) {
      const __m256 v = _mm256_loadu_ps(value + 8 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(p[g], v, acc[g][c]);
    }
  }
}

// A row's whole weighted values for dimensions 8 c0 .. 8 (c0 + W), normalized by each head's total.
template <int G, int W>
RADIXLM_AVX2 inline void weigh_values(const float* values, int64_t head_dim, const int64_t* slots, int64_t len,
                                      const float* scores, const float* total, int64_t c0, float* out) {
  __m256 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < W; ++c) acc[g][c] = _mm256_setzero_ps();
  accumulate<G, W>(acc, values, head_dim, slots, 0, len, scores, len, c0);
  for (int g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.0f / total[g]);
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(out + g * head_dim + 8 * (c0 + c), _mm256_mul_ps(acc[g][c], inv));
  }
}

// Scores of G query heads (q_g at q + g * head_dim) against keys [a, b) of a row, scores[g * stride
// + j], their running maxima in top: U keys at a time, G x U independent chains of multiply-adds
// (at most 12, in registers), where one key's G chains alone would wait on the multiply-add's
// latency. Each key's score is the same chain whatever range or batch of keys it falls in.
template <int G>
RADIXLM_AVX2 inline void score_keys(const float* q, int64_t head_dim, const float* keys, const int64_t* slots, int64_t a,
                                    int64_t b, float scale, float* scores, int64_t stride, float* top) {
  const int64_t chunks = head_dim / 8;
  constexpr int U = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  int64_t j = a;
  for (; j + U <= b; j += U) {
    const float* key[U];
    for (int u = 0; u < U; ++u) key[u] = keys + slots[j + u] * head_dim;
    __m256 acc[U][G];
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) acc[u][g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i)
      for (int u = 0; u < U; ++u) {
        const __m256 k = _mm256_loadu_ps(key[u] + 8 * i);
        for (int g = 0; g < G; ++g) acc[u][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + 8 * i), k, acc[u][g]);
      }
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) {
        const float s = hsum(acc[u][g]) * scale;
        scores[g * stride + j + u] = s;
        top[g] = max_score(top[g], s);
      }
  }
  for (; j < b; ++j) {  // the rest one key at a time: the same chains
    const float* key = keys + slots[j] * head_dim;
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) {
      const __m256 k = _mm256_loadu_ps(key + 8 * i);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + 8 * i), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      const float s = hsum(acc[g]) * scale;
      scores[g * stride + j] = s;
      top[g] = max_score(top[g], s);
    }
  }
}

// decode_head_avx2's exp and sum, head by head, over a row's len scores (head g's at scores + g * len).
template <int G>
RADIXLM_AVX2 inline void softmax_heads(float* scores, int64_t len, const float* top, float* total) {
  for (int g = 0; g < G; ++g) {
    float* sc = scores + g * len;
    const __m256 topv = _mm256_set1_ps(top[g]);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + j), topv));
      _mm256_storeu_ps(sc + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[g] = hsum(sum);
    for (; j < len; ++j) {
      sc[j] = std::exp(sc[j] - top[g]);
      total[g] += sc[j];
    }
  }
}

// The weighted values of G heads over a row, W chunks of 8 dimensions at a time: G x W
// accumulators and the G weights of a key stay in registers (more would spill to the stack on
// every key).
template <int G>
constexpr int kWeighWidth = std::max(1, std::min(4, (14 - G) / G));

// decode_head_avx2 for G query heads sharing KV head `kv_head` (q_g at q + g * head_dim): each key
// and value row read once for the G heads, each head's sums the same chains in the same order as
// decode_head_avx2's, so the results are bitwise its results.
template <int G>
RADIXLM_AVX2 void decode_group(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                               const int64_t* slots, int64_t len, float scale, float* scores, float* out) {
  const float* keys = kv.k + kv_head * kv.slots * head_dim;
  const float* values = kv.v + kv_head * kv.slots * head_dim;
  const int64_t chunks = head_dim / 8;
  float top[G], total[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  score_keys<G>(q, head_dim, keys, slots, 0, len, scale, scores, len, top);
  softmax_heads<G>(scores, len, top, total);
  constexpr int W = kWeighWidth<G>;
  int64_t c0 = 0;
  for (; c0 + W <= chunks; c0 += W) weigh_values<G, W>(values, head_dim, slots, len, scores, total, c0, out);
  for (; c0 < chunks; ++c0) weigh_values<G, 1>(values, head_dim, slots, len, scores, total, c0, out);
}

// weigh_values' chains over keys [k0, k1) only, its accumulators carried in memory (acc: G x W
// vectors, head g's chunk c at acc + 8 (g W + c)), so that a row's keys may be taken in pieces,
// between which other rows take theirs: the same multiply-adds in the same order.
template <int G, int W>
RADIXLM_AVX2 inline void weigh_keys(const float* values, int64_t head_dim, const int64_t* slots, int64_t k0, int64_t k1,
                                    const float* scores, int64_t len, int64_t c0, float* acc_mem) {
  __m256 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < W; ++c) acc[g][c] = _mm256_loadu_ps(acc_mem + 8 * (g * W + c));
  accumulate<G, W>(acc, values, head_dim, slots, k0, k1, scores, len, c0);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc_mem + 8 * (g * W + c), acc[g][c]);
}

// Keys [k0, k1) of one row into its accumulators (acc: the row's, head_dim / 8 passes' worth).
template <int G>
RADIXLM_AVX2 inline void weigh_row(const float* values, int64_t head_dim, const int64_t* slots, int64_t k0, int64_t k1,
                                   const float* scores, int64_t len, float* acc) {
  constexpr int W = kWeighWidth<G>;
  const int64_t chunks = head_dim / 8;
  int64_t c0 = 0;
  for (; c0 + W <= chunks; c0 += W) weigh_keys<G, W>(values, head_dim, slots, k0, k1, scores, len, c0, acc + 8 * G * c0);
  for (; c0 < chunks; ++c0) weigh_keys<G, 1>(values, head_dim, slots, k0, k1, scores, len, c0, acc + 8 * G * c0);
}

// Keys a block of rows takes together: a block's keys and values stay in L1 while every row of
// the set reads them (64 keys of 64 dimensions: 16 KB each).
constexpr int64_t kSharedKeyBlock = 64;

// decode_group for the rows of a set whose first `shared` keys are the same slots: those keys and
// values are read once, a block at a time, for every row's heads, each row's chains unbroken.
template <int G>
RADIXLM_AVX2 void decode_shared(const SharedRows& set, int64_t head_dim, const KVLayer& kv, int64_t kv_head, float scale,
                                float* scratch) {
  const float* keys = kv.k + kv_head * kv.slots * head_dim;
  const float* values = kv.v + kv_head * kv.slots * head_dim;
  const int64_t n = set.n, shared = set.shared, chunks = head_dim / 8;
  std::vector<float*> scores(n);
  float* at = scratch;
  for (int64_t r = 0; r < n; ++r) {
    scores[r] = at;
    at += G * set.lens[r];
  }
  float* acc = at;  // n x G x head_dim: row r's head g's dimension pass c at acc + (r G chunks + G c + ...) * 8
  std::fill(acc, acc + n * G * head_dim, 0.0f);
  std::vector<float> top(n * G, -INFINITY), total(n * G);
  for (int64_t j0 = 0; j0 < shared; j0 += kSharedKeyBlock)
    for (int64_t r = 0; r < n; ++r)
      score_keys<G>(set.q[r], head_dim, keys, set.slots[r], j0, std::min(shared, j0 + kSharedKeyBlock), scale, scores[r],
                    set.lens[r], &top[r * G]);
  for (int64_t r = 0; r < n; ++r) {
    score_keys<G>(set.q[r], head_dim, keys, set.slots[r], shared, set.lens[r], scale, scores[r], set.lens[r], &top[r * G]);
    softmax_heads<G>(scores[r], set.lens[r], &top[r * G], &total[r * G]);
  }
  for (int64_t k0 = 0; k0 < shared; k0 += kSharedKeyBlock)
    for (int64_t r = 0; r < n; ++r)
      weigh_row<G>(values, head_dim, set.slots[r], k0, std::min(shared, k0 + kSharedKeyBlock), scores[r], set.lens[r],
                   acc + r * G * head_dim);
  for (int64_t r = 0; r < n; ++r) {
    float* row_acc = acc + r * G * head_dim;
    weigh_row<G>(values, head_dim, set.slots[r], shared, set.lens[r], scores[r], set.lens[r], row_acc);
    // weigh_values' last step: each chunk's sums times 1 / total. Pass p (W chunks from c0) keeps
    // head g's chunk c at row_acc + 8 (G c0 + g W_p + c)
    constexpr int W = kWeighWidth<G>;
    int64_t c0 = 0;
    while (c0 < chunks) {
      const int64_t width = c0 + W <= chunks ? W : 1;
      for (int g = 0; g < G; ++g) {
        const __m256 inv = _mm256_set1_ps(1.0f / total[r * G + g]);
        for (int64_t c = 0; c < width; ++c)
          _mm256_storeu_ps(set.out[r] + g * head_dim + 8 * (c0 + c),
                           _mm256_mul_ps(_mm256_loadu_ps(row_acc + 8 * (G * c0 + g * width + c)), inv));
      }
      c0 += width;
    }
  }
}

}  // namespace

RADIXLM_AVX2 void decode_shared_avx2(const SharedRows& set, int64_t heads, int64_t head_dim, const KVLayer& kv,
                                     int64_t kv_head, float scale, float* scratch) {
  switch (heads) {
    case 1: decode_shared<1>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 2: decode_shared<2>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 3: decode_shared<3>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 4: decode_shared<4>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 5: decode_shared<5>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 6: decode_shared<6>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 7: decode_shared<7>(set, head_dim, kv, kv_head, scale, scratch); return;
    case 8: decode_shared<8>(set, head_dim, kv, kv_head, scale, scratch); return;
    default: return;  // decode_group_takes excludes it
  }
}

RADIXLM_AVX2 void decode_group_avx2(const float* q, int64_t heads, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                                    const int64_t* slots, int64_t len, float scale, float* scores, float* out) {
  switch (heads) {
    case 1: decode_group<1>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 2: decode_group<2>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 3: decode_group<3>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 4: decode_group<4>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 5: decode_group<5>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 6: decode_group<6>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 7: decode_group<7>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    case 8: decode_group<8>(q, head_dim, kv, kv_head, slots, len, scale, scores, out); return;
    default: return;  // decode_group_takes excludes it
  }
}

}  // namespace radixlm
