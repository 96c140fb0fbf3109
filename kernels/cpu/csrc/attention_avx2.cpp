// The AVX2 path of rotary + K/V store and of paged decode attention (head_dim a multiple of 8;
// others take the portable path). Written once over the pool's element type (kv_types.h): each
// key and value vector converted to fp32 as it is loaded (load8), an int8 row's scale applied
// once per row (its score, its weight), in the same order on every kernel here, so the grouped
// and shared kernels stay bitwise the per-head one on every type.
#include "common.h"  // RADIXLM_X86: the vector paths are built on x86 only
#if RADIXLM_X86

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

// 8 floats into a row of type E at p, rounded to nearest even as kv_types.h's store_row (fp16
// saturated first; bf16: NaN made 0x7FC0, the rest rounded on the integer bits).
template <class E>
RADIXLM_AVX2 inline void store8(__m256 x, typename E::T* p) {
  if constexpr (std::is_same_v<E, F16>) {  // max/min with x second: a NaN passes through
    x = _mm256_min_ps(_mm256_set1_ps(kHalfMax), _mm256_max_ps(_mm256_set1_ps(-kHalfMax), x));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 x 16 bits, in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}

template <class E>
RADIXLM_AVX2 void rope_store(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                             const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1) {
  const int64_t d = x.head_dim;
  auto* keys = static_cast<typename E::T*>(kv.k);
  auto* values = static_cast<typename E::T*>(kv.v);
  for (int64_t t = t0; t < t1; ++t) {
    float* row = x.qkv + t * x.row_stride;
    const float* cos = cos2 + positions[t] * d;
    const float* sin = sin2 + positions[t] * d;
    for (int64_t h = 0; h < x.heads + x.kv_heads; ++h) rotate(row + h * d, cos, sin, d);
    if constexpr (E::scaled) {  // a row's scale needs its whole maximum first: the portable store (a row per head)
      store_kv_portable(x, row, kv, out_slots[t]);
      continue;
    }
    const float* k = row + x.heads * d;
    const float* v = k + x.kv_heads * d;
    for (int64_t h = 0; h < x.kv_heads; ++h)
      for (int64_t i = 0; i < d; i += 8) {
        const int64_t at = (h * kv.slots + out_slots[t]) * d + i;
        if constexpr (std::is_same_v<E, F32>) {
          _mm256_storeu_ps(keys + at, _mm256_loadu_ps(k + h * d + i));
          _mm256_storeu_ps(values + at, _mm256_loadu_ps(v + h * d + i));
        } else {
          store8<E>(_mm256_loadu_ps(k + h * d + i), keys + at);
          store8<E>(_mm256_loadu_ps(v + h * d + i), values + at);
        }
      }
  }
}

}  // namespace

RADIXLM_AVX2 void rope_store_avx2(const TokenLayout& x, const int64_t* positions, const float* cos2, const float* sin2,
                                  const KVLayer& kv, const int64_t* out_slots, int64_t t0, int64_t t1) {
  if (x.head_dim % 16) return rope_store_portable(x, positions, cos2, sin2, kv, out_slots, t0, t1);
  switch (kv.type) {
    case KVType::f16: return rope_store<F16>(x, positions, cos2, sin2, kv, out_slots, t0, t1);
    case KVType::bf16: return rope_store<BF16>(x, positions, cos2, sin2, kv, out_slots, t0, t1);
    case KVType::i8: return rope_store<I8>(x, positions, cos2, sin2, kv, out_slots, t0, t1);
    default: return rope_store<F32>(x, positions, cos2, sin2, kv, out_slots, t0, t1);
  }
}

namespace {

// The exp of each score against its head's maximum and their sum, head by head, over a row's len
// scores (head g's at scores + g * len): 8 scores a vector, then the rest one by one; a head's
// sink (where it has one; its maximum is then no smaller) adds its term after the vectors'.
// With a soft cap the scores come uncapped (the scoring loops carry no call to tanh: a call there
// spills their accumulators, ~10% of the plain kernels): each is capped here first and its head's
// maximum taken again over the capped scores, the values the portable path's scores have.
template <int G>
RADIXLM_AVX2 inline void softmax_heads(float* scores, int64_t len, float* top, float* total, const Logits& logits) {
  for (int g = 0; g < G; ++g) {
    float* sc = scores + g * len;
    if (logits.softcap > 0) {
      top[g] = logits.sink(g);
      for (int64_t j = 0; j < len; ++j) {
        sc[j] = logits.cap(sc[j]);
        top[g] = max_score(top[g], sc[j]);
      }
    }
    const __m256 topv = _mm256_set1_ps(top[g]);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + j), topv));
      _mm256_storeu_ps(sc + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[g] = hsum(sum);
    if (logits.sinks != nullptr) total[g] += std::exp(logits.sinks[g] - top[g]);
    for (; j < len; ++j) {
      sc[j] = std::exp(sc[j] - top[g]);
      total[g] += sc[j];
    }
  }
}

template <class E>
RADIXLM_AVX2 void decode_head(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                              const int64_t* slots, int64_t len, const Logits& logits, float* scores, float* out) {
  constexpr int64_t kMaxChunks = 32;  // head_dim up to 256
  const KVRows<E> keys = kv.keys<E>(kv_head), values = kv.values<E>(kv_head);
  float top = logits.sink(0), total;
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {  // four keys at a time: four independent chains of multiply-adds
    const typename E::T* key[4] = {keys.at(slots[j]), keys.at(slots[j + 1]), keys.at(slots[j + 2]), keys.at(slots[j + 3])};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < head_dim; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int u = 0; u < 4; ++u) acc[u] = _mm256_fmadd_ps(qv, load8<E>(key[u] + i), acc[u]);
    }
    for (int u = 0; u < 4; ++u) {
      scores[j + u] = hsum(acc[u]) * keys.key_factor(slots[j + u], logits.scale);
      top = max_score(top, scores[j + u]);
    }
  }
  for (; j < len; ++j) {  // the same sums, one key at a time
    const typename E::T* key = keys.at(slots[j]);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < head_dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8<E>(key + i), acc);
    scores[j] = hsum(acc) * keys.key_factor(slots[j], logits.scale);
    top = max_score(top, scores[j]);
  }
  softmax_heads<1>(scores, len, &top, &total, logits);
  __m256 acc[kMaxChunks];
  const int64_t chunks = head_dim / 8;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < len; ++k) {  // each value row read once, whole
    const __m256 p = _mm256_set1_ps(values.value_weight(slots[k], scores[k]));
    const typename E::T* value = values.at(slots[k]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(p, load8<E>(value + 8 * c), acc[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

}  // namespace

RADIXLM_AVX2 void decode_head_avx2(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                                   const int64_t* slots, int64_t len, const Logits& logits, float* scores, float* out) {
  if (head_dim % 8 || head_dim > 256) return decode_head_portable(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
  switch (kv.type) {
    case KVType::f16: return decode_head<F16>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case KVType::bf16: return decode_head<BF16>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case KVType::i8: return decode_head<I8>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    default: return decode_head<F32>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
  }
}

namespace {

// Dimensions 8 c0 .. 8 (c0 + W) of G heads' weighted values over keys [k0, k1), into acc: each
// key's value chunk read once, weighted for the G heads (each accumulator sums over the keys in
// key order, as decode_head_avx2's).
template <class E, int G, int W>
RADIXLM_AVX2 __attribute__((always_inline)) inline void accumulate(__m256 (&acc)[G][W], const KVRows<E>& values,
                                                                  const int64_t* slots, int64_t k0, int64_t k1,
                                                                  const float* scores, int64_t len, int64_t c0) {
  for (int64_t k = k0; k < k1; ++k) {
    const typename E::T* value = values.at(slots[k]) + 8 * c0;
    __m256 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm256_set1_ps(values.value_weight(slots[k], scores[g * len + k]));
    for (int c = 0; c < W; ++c) {
      const __m256 v = load8<E>(value + 8 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(p[g], v, acc[g][c]);
    }
  }
}

// A row's whole weighted values for dimensions 8 c0 .. 8 (c0 + W), normalized by each head's total.
template <class E, int G, int W>
RADIXLM_AVX2 inline void weigh_values(const KVRows<E>& values, int64_t head_dim, const int64_t* slots, int64_t len,
                                      const float* scores, const float* total, int64_t c0, float* out) {
  __m256 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < W; ++c) acc[g][c] = _mm256_setzero_ps();
  accumulate<E, G, W>(acc, values, slots, 0, len, scores, len, c0);
  for (int g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.0f / total[g]);
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(out + g * head_dim + 8 * (c0 + c), _mm256_mul_ps(acc[g][c], inv));
  }
}

// Scores of G query heads (q_g at q + g * head_dim) against keys [a, b) of a row, scores[g * stride
// + j] (uncapped: softmax_heads caps them), their running maxima in top: U keys at a time, G x U independent chains of multiply-adds
// (at most 12, in registers), where one key's G chains alone would wait on the multiply-add's
// latency. Each key's score is the same chain whatever range or batch of keys it falls in.
template <class E, int G>
RADIXLM_AVX2 inline void score_keys(const float* q, int64_t head_dim, const KVRows<E>& keys, const int64_t* slots,
                                    int64_t a, int64_t b, const Logits& logits, float* scores, int64_t stride,
                                    float* top) {
  const int64_t chunks = head_dim / 8;
  constexpr int U = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  int64_t j = a;
  for (; j + U <= b; j += U) {
    const typename E::T* key[U];
    for (int u = 0; u < U; ++u) key[u] = keys.at(slots[j + u]);
    __m256 acc[U][G];
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) acc[u][g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i)
      for (int u = 0; u < U; ++u) {
        const __m256 k = load8<E>(key[u] + 8 * i);
        for (int g = 0; g < G; ++g) acc[u][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + 8 * i), k, acc[u][g]);
      }
    for (int u = 0; u < U; ++u) {
      const float factor = keys.key_factor(slots[j + u], logits.scale);
      for (int g = 0; g < G; ++g) {
        const float s = hsum(acc[u][g]) * factor;
        scores[g * stride + j + u] = s;
        top[g] = max_score(top[g], s);
      }
    }
  }
  for (; j < b; ++j) {  // the rest one key at a time: the same chains
    const typename E::T* key = keys.at(slots[j]);
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) {
      const __m256 k = load8<E>(key + 8 * i);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + 8 * i), k, acc[g]);
    }
    const float factor = keys.key_factor(slots[j], logits.scale);
    for (int g = 0; g < G; ++g) {
      const float s = hsum(acc[g]) * factor;
      scores[g * stride + j] = s;
      top[g] = max_score(top[g], s);
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
template <class E, int G>
RADIXLM_AVX2 void decode_group(const float* q, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                               const int64_t* slots, int64_t len, const Logits& logits, float* scores, float* out) {
  const KVRows<E> keys = kv.keys<E>(kv_head), values = kv.values<E>(kv_head);
  const int64_t chunks = head_dim / 8;
  float top[G], total[G];
  for (int g = 0; g < G; ++g) top[g] = logits.sink(g);
  score_keys<E, G>(q, head_dim, keys, slots, 0, len, logits, scores, len, top);
  softmax_heads<G>(scores, len, top, total, logits);
  constexpr int W = kWeighWidth<G>;
  int64_t c0 = 0;
  for (; c0 + W <= chunks; c0 += W) weigh_values<E, G, W>(values, head_dim, slots, len, scores, total, c0, out);
  for (; c0 < chunks; ++c0) weigh_values<E, G, 1>(values, head_dim, slots, len, scores, total, c0, out);
}

// weigh_values' chains over keys [k0, k1) only, its accumulators carried in memory (acc: G x W
// vectors, head g's chunk c at acc + 8 (g W + c)), so that a row's keys may be taken in pieces,
// between which other rows take theirs: the same multiply-adds in the same order.
template <class E, int G, int W>
RADIXLM_AVX2 inline void weigh_keys(const KVRows<E>& values, const int64_t* slots, int64_t k0, int64_t k1,
                                    const float* scores, int64_t len, int64_t c0, float* acc_mem) {
  __m256 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < W; ++c) acc[g][c] = _mm256_loadu_ps(acc_mem + 8 * (g * W + c));
  accumulate<E, G, W>(acc, values, slots, k0, k1, scores, len, c0);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc_mem + 8 * (g * W + c), acc[g][c]);
}

// Keys [k0, k1) of one row into its accumulators (acc: the row's, head_dim / 8 passes' worth).
template <class E, int G>
RADIXLM_AVX2 inline void weigh_row(const KVRows<E>& values, int64_t head_dim, const int64_t* slots, int64_t k0,
                                   int64_t k1, const float* scores, int64_t len, float* acc) {
  constexpr int W = kWeighWidth<G>;
  const int64_t chunks = head_dim / 8;
  int64_t c0 = 0;
  for (; c0 + W <= chunks; c0 += W) weigh_keys<E, G, W>(values, slots, k0, k1, scores, len, c0, acc + 8 * G * c0);
  for (; c0 < chunks; ++c0) weigh_keys<E, G, 1>(values, slots, k0, k1, scores, len, c0, acc + 8 * G * c0);
}

// Keys a block of rows takes together: a block's keys and values stay in L1 while every row of
// the set reads them (64 keys of 64 dimensions: 16 KB each in fp32).
constexpr int64_t kSharedKeyBlock = 64;

// decode_group for the rows of a set whose first `shared` keys are the same slots: those keys and
// values are read once, a block at a time, for every row's heads, each row's chains unbroken.
template <class E, int G>
RADIXLM_AVX2 void decode_shared(const SharedRows& set, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                                const Logits& logits, float* scratch) {
  const KVRows<E> keys = kv.keys<E>(kv_head), values = kv.values<E>(kv_head);
  const int64_t n = set.n, shared = set.shared, chunks = head_dim / 8;
  std::vector<float*> scores(n);
  float* at = scratch;
  for (int64_t r = 0; r < n; ++r) {
    scores[r] = at;
    at += G * set.lens[r];
  }
  float* acc = at;  // n x G x head_dim: row r's head g's dimension pass c at acc + (r G chunks + G c + ...) * 8
  std::fill(acc, acc + n * G * head_dim, 0.0f);
  std::vector<float> top(n * G), total(n * G);
  for (int64_t i = 0; i < n * G; ++i) top[i] = logits.sink(i % G);
  for (int64_t j0 = 0; j0 < shared; j0 += kSharedKeyBlock)
    for (int64_t r = 0; r < n; ++r)
      score_keys<E, G>(set.q[r], head_dim, keys, set.slots[r], j0, std::min(shared, j0 + kSharedKeyBlock), logits,
                       scores[r], set.lens[r], &top[r * G]);
  for (int64_t r = 0; r < n; ++r) {
    score_keys<E, G>(set.q[r], head_dim, keys, set.slots[r], shared, set.lens[r], logits, scores[r], set.lens[r],
                     &top[r * G]);
    softmax_heads<G>(scores[r], set.lens[r], &top[r * G], &total[r * G], logits);
  }
  for (int64_t k0 = 0; k0 < shared; k0 += kSharedKeyBlock)
    for (int64_t r = 0; r < n; ++r)
      weigh_row<E, G>(values, head_dim, set.slots[r], k0, std::min(shared, k0 + kSharedKeyBlock), scores[r],
                      set.lens[r], acc + r * G * head_dim);
  for (int64_t r = 0; r < n; ++r) {
    float* row_acc = acc + r * G * head_dim;
    weigh_row<E, G>(values, head_dim, set.slots[r], shared, set.lens[r], scores[r], set.lens[r], row_acc);
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

template <class E>
RADIXLM_AVX2 void decode_shared_heads(const SharedRows& set, int64_t heads, int64_t head_dim, const KVLayer& kv,
                                      int64_t kv_head, const Logits& logits, float* scratch) {
  switch (heads) {
    case 1: return decode_shared<E, 1>(set, head_dim, kv, kv_head, logits, scratch);
    case 2: return decode_shared<E, 2>(set, head_dim, kv, kv_head, logits, scratch);
    case 3: return decode_shared<E, 3>(set, head_dim, kv, kv_head, logits, scratch);
    case 4: return decode_shared<E, 4>(set, head_dim, kv, kv_head, logits, scratch);
    case 5: return decode_shared<E, 5>(set, head_dim, kv, kv_head, logits, scratch);
    case 6: return decode_shared<E, 6>(set, head_dim, kv, kv_head, logits, scratch);
    case 7: return decode_shared<E, 7>(set, head_dim, kv, kv_head, logits, scratch);
    case 8: return decode_shared<E, 8>(set, head_dim, kv, kv_head, logits, scratch);
    default: return;  // decode_group_takes excludes it
  }
}

template <class E>
RADIXLM_AVX2 void decode_group_heads(const float* q, int64_t heads, int64_t head_dim, const KVLayer& kv,
                                     int64_t kv_head, const int64_t* slots, int64_t len, const Logits& logits, float* scores,
                                     float* out) {
  switch (heads) {
    case 1: return decode_group<E, 1>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 2: return decode_group<E, 2>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 3: return decode_group<E, 3>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 4: return decode_group<E, 4>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 5: return decode_group<E, 5>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 6: return decode_group<E, 6>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 7: return decode_group<E, 7>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case 8: return decode_group<E, 8>(q, head_dim, kv, kv_head, slots, len, logits, scores, out);
    default: return;  // decode_group_takes excludes it
  }
}

}  // namespace

RADIXLM_AVX2 void decode_shared_avx2(const SharedRows& set, int64_t heads, int64_t head_dim, const KVLayer& kv,
                                     int64_t kv_head, const Logits& logits, float* scratch) {
  switch (kv.type) {
    case KVType::f16: return decode_shared_heads<F16>(set, heads, head_dim, kv, kv_head, logits, scratch);
    case KVType::bf16: return decode_shared_heads<BF16>(set, heads, head_dim, kv, kv_head, logits, scratch);
    case KVType::i8: return decode_shared_heads<I8>(set, heads, head_dim, kv, kv_head, logits, scratch);
    default: return decode_shared_heads<F32>(set, heads, head_dim, kv, kv_head, logits, scratch);
  }
}

RADIXLM_AVX2 void decode_group_avx2(const float* q, int64_t heads, int64_t head_dim, const KVLayer& kv, int64_t kv_head,
                                    const int64_t* slots, int64_t len, const Logits& logits, float* scores, float* out) {
  switch (kv.type) {
    case KVType::f16: return decode_group_heads<F16>(q, heads, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case KVType::bf16: return decode_group_heads<BF16>(q, heads, head_dim, kv, kv_head, slots, len, logits, scores, out);
    case KVType::i8: return decode_group_heads<I8>(q, heads, head_dim, kv, kv_head, slots, len, logits, scores, out);
    default: return decode_group_heads<F32>(q, heads, head_dim, kv, kv_head, slots, len, logits, scores, out);
  }
}

}  // namespace radixlm

#endif  // RADIXLM_X86
