// The blocked attention loop (extend.h's BlockedTask), written once for every vector ISA: each
// ISA's file includes this inside its target region with its vector traits V (lanes L; T the
// register type; zero, load, store, set1, add, sub, mul, max, fma, exp, hmax, hsum, load_kv<E> (L
// elements of a pool row of type E as fp32); RQ and RP the query rows its score and value kernels
// keep in registers, C the value vectors a row holds).
//
// A task's query rows (its sources' tokens x one KV head's query heads) go over their keys
// kExtendKeys (B) at a time: first the keys every source shares, for all the rows, then each
// source's own keys for its rows. Per block: the keys packed transposed (kt [d][B]) so that a
// vector holds one dimension of L keys; scores of the queries (scaled once) for RQ rows at a time,
// each its dot product summed over d in order, one lane a key; each row's scores capped, masked
// (keys after its position or before its window) and folded into its running max and sum (the
// online softmax: earlier blocks' sums rescaled when the max grows); then the block's weighted
// values added to the row's accumulators, keys in order, each value row read in place from the
// pool. The pool's element type E (kv_types.h) is converted as it is read: keys when packed (an
// int8 key times its scale there), values as they are loaded (an int8 value's scale folded into
// each row's weight of it). Every name here has internal linkage: each ISA's file keeps its own instantiations, built
// for its own instructions.
#pragma once

#include <cmath>
#include <cstdint>

#include "avx2.h"
#include "extend.h"

namespace radixlm {
namespace {

constexpr int64_t B = kExtendKeys;

// s[r][0..B) = q[r] . key j for RR rows (q [RR][d]) against the packed block kt [d][B].
template <class V, int RR>
inline void score_block(const float* q, int64_t d, const float* kt, float* s) {
  using T = typename V::T;
  for (int64_t j = 0; j < B; j += 2 * V::L) {
    T acc[RR][2];
    for (int r = 0; r < RR; ++r) acc[r][0] = acc[r][1] = V::zero();
    for (int64_t i = 0; i < d; ++i) {
      const T k0 = V::load(kt + i * B + j), k1 = V::load(kt + i * B + j + V::L);
      for (int r = 0; r < RR; ++r) {
        const T qv = V::set1(q[r * d + i]);
        acc[r][0] = V::fma(qv, k0, acc[r][0]);
        acc[r][1] = V::fma(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < RR; ++r) {
      V::store(s + r * B + j, acc[r][0]);
      V::store(s + r * B + j + V::L, acc[r][1]);
    }
  }
}

// score_block for the last `rest` (< RR) rows: the kernel of that many rows.
template <class V, int RR>
inline void score_rest(int rest, const float* q, int64_t d, const float* kt, float* s) {
  if constexpr (RR > 0) {
    if (rest == RR) return score_block<V, RR>(q, d, kt, s);
    score_rest<V, RR - 1>(rest, q, d, kt, s);
  }
}

// acc[r][c0 .. c0 + C L) += sum over keys j < nk, in order, of p[r][j] * value_j for RR rows.
template <class V, class E, int RR, int C>
inline void weigh_block(const float* p, const typename E::T* const* values, int64_t nk, int64_t c0, float* acc,
                        int64_t d) {
  using T = typename V::T;
  T a[RR][C];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = V::load(acc + r * d + c0 + c * V::L);
  for (int64_t j = 0; j < nk; ++j) {
    T v[C];
    for (int c = 0; c < C; ++c) v[c] = V::template load_kv<E>(values[j] + c0 + c * V::L);
    for (int r = 0; r < RR; ++r) {
      const T pr = V::set1(p[r * B + j]);
      for (int c = 0; c < C; ++c) a[r][c] = V::fma(pr, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) V::store(acc + r * d + c0 + c * V::L, a[r][c]);
}

// weigh_block over the last `rest` (< C) vectors of the rows' dimensions.
template <class V, class E, int RR, int C>
inline void weigh_rest(int rest, const float* p, const typename E::T* const* values, int64_t nk, int64_t c0,
                       float* acc, int64_t d) {
  if constexpr (C > 0) {
    if (rest == C) return weigh_block<V, E, RR, C>(p, values, nk, c0, acc, d);
    weigh_rest<V, E, RR, C - 1>(rest, p, values, nk, c0, acc, d);
  }
}

// RR rows' weighted values, every dimension: C vectors at a time, then the rest.
template <class V, class E, int RR>
inline void weigh_rows(const float* p, const typename E::T* const* values, int64_t nk, float* acc, int64_t d) {
  const int64_t step = V::C * V::L;
  int64_t c0 = 0;
  for (; c0 + step <= d; c0 += step) weigh_block<V, E, RR, V::C>(p, values, nk, c0, acc, d);
  if (c0 < d) weigh_rest<V, E, RR, V::C - 1>(int((d - c0) / V::L), p, values, nk, c0, acc, d);
}

// weigh_rows for the last `rest` (< RP) rows.
template <class V, class E, int RR>
inline void weigh_rows_rest(int rest, const float* p, const typename E::T* const* values, int64_t nk, float* acc,
                            int64_t d) {
  if constexpr (RR > 0) {
    if (rest == RR) return weigh_rows<V, E, RR>(p, values, nk, acc, d);
    weigh_rows_rest<V, E, RR - 1>(rest, p, values, nk, acc, d);
  }
}

// Row i's block of scores s[0..B) (keys k0.., nk of them real; its query was scaled) into weights: capped,
// keys outside [first, last] hidden, folded into the running max m and sum l, and its
// accumulated values acc[0..d) rescaled if the max grew. Returns false where the row sees no key
// of the block (its weights are then all zero).
template <class V>
inline bool softmax_row(float* s, int64_t k0, int64_t nk, int64_t first, int64_t last, float softcap,
                        float* m, float* l, float* acc, int64_t d) {
  using T = typename V::T;
  const int64_t begin = first > k0 ? first - k0 : 0, end = last - k0 + 1 < nk ? last - k0 + 1 : nk;
  if (end <= begin) {
    for (int64_t j = 0; j < B; ++j) s[j] = 0.0f;
    return false;
  }
  if (softcap > 0)
    for (int64_t j = begin; j < end; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  for (int64_t j = 0; j < begin; ++j) s[j] = -INFINITY;
  for (int64_t j = end; j < B; ++j) s[j] = -INFINITY;
  T top = V::load(s);
  for (int64_t j = V::L; j < B; j += V::L) top = V::max(top, V::load(s + j));
  const float block_top = V::hmax(top), new_m = *m > block_top ? *m : block_top;
  const T mv = V::set1(new_m);
  for (int64_t j = 0; j < B; j += V::L) V::store(s + j, V::exp(V::sub(V::load(s + j), mv)));
  for (int64_t j = 0; j < begin; ++j) s[j] = 0.0f;  // exp's clamp leaves hidden keys ~1e-38, not 0
  for (int64_t j = end; j < B; ++j) s[j] = 0.0f;
  T sum = V::load(s);
  for (int64_t j = V::L; j < B; j += V::L) sum = V::add(sum, V::load(s + j));
  const float total = V::hsum(sum);
  if (new_m != *m) {
    const float corr = std::exp(*m - new_m);  // 0 on the row's first block (m = -inf)
    const T cv = V::set1(corr);
    for (int64_t c = 0; c < d; c += V::L) V::store(acc + c, V::mul(V::load(acc + c), cv));
    *l *= corr;
    *m = new_m;
  }
  *l += total;
  return true;
}

// The task's query rows [lo, hi) against keys [k_from, k_to) read through `slots`, a block at a
// time, folded into their running softmax (m, l) and values (acc). pos[i]: row i's position (it
// sees keys up to it, and the last `window` of them where window > 0).
template <class V, class E>
void attend_range(const KVLayer& kv, int64_t kv_head, int64_t d, const int64_t* slots, int64_t k_from, int64_t k_to,
                  int64_t lo, int64_t hi, const int64_t* pos, int64_t window, float softcap, const float* q, float* acc,
                  float* s, float* m, float* l, float* kt) {
  const KVRows<E> keys = kv.keys<E>(kv_head), vals = kv.values<E>(kv_head);
  const typename E::T* values[B];
  float value_scale[B];
  const int64_t rows = hi - lo;
  q += lo * d, acc += lo * d, s += lo * B, m += lo, l += lo, pos += lo;
  for (int64_t k0 = k_from; k0 < k_to; k0 += B) {
    const int64_t nk = k_to - k0 < B ? k_to - k0 : B;
    // (a last block's columns past nk keep an earlier block's keys: their scores are masked)
    pack_transposed<E>(keys, slots + k0, nk, d, B, kt);
    for (int64_t j = 0; j < nk; ++j) {
      values[j] = vals.at(slots[k0 + j]);
      value_scale[j] = vals.scale(slots[k0 + j]);
    }
    int64_t i = 0;
    for (; i + V::RQ <= rows; i += V::RQ) score_block<V, V::RQ>(q + i * d, d, kt, s + i * B);
    if (i < rows) score_rest<V, V::RQ - 1>(int(rows - i), q + i * d, d, kt, s + i * B);
    int64_t first_row = rows, end_row = 0;  // the rows that see any key of the block
    for (i = 0; i < rows; ++i) {
      const int64_t first = window > 0 ? pos[i] - window + 1 : 0;
      if (softmax_row<V>(s + i * B, k0, nk, first, pos[i], softcap, m + i, l + i, acc + i * d, d)) {
        first_row = i < first_row ? i : first_row;
        end_row = i + 1;
        if constexpr (E::scaled)  // (the sum l has the weights as they are; the values take them scaled)
          for (int64_t j = 0; j < nk; ++j) s[i * B + j] *= value_scale[j];
      }
    }
    for (i = first_row; i + V::RP <= end_row; i += V::RP) weigh_rows<V, E, V::RP>(s + i * B, values, nk, acc + i * d, d);
    if (i < end_row) weigh_rows_rest<V, E, V::RP - 1>(int(end_row - i), s + i * B, values, nk, acc + i * d, d);
  }
}

template <class V, class E>
void attend_sources(const QueryLayout& x, const KVLayer& kv, const BlockedTask& task, float* scratch, int64_t* pos) {
  const int64_t d = x.head_dim, group = x.heads / x.kv_heads;
  int64_t rows = 0;
  for (int64_t k = 0; k < task.n; ++k) rows += task.sources[k].tokens * group;
  float* q = scratch;           // [rows][d]: source by source, token by token, head by head
  float* acc = q + rows * d;    // [rows][d]
  float* s = acc + rows * d;    // [rows][B]
  float* m = s + rows * B;      // [rows]
  float* l = m + rows;          // [rows]
  float* kt = l + rows;         // [d][B]
  for (int64_t k = 0, i = 0; k < task.n; ++k) {
    const QuerySource& src = task.sources[k];
    for (int64_t r = 0; r < src.tokens * group; ++r, ++i) {
      const float* from = x.q + (src.token + r / group) * x.q_stride + (task.kv_head * group + r % group) * d;
      for (int64_t c = 0; c < d; ++c) q[i * d + c] = from[c] * x.scale, acc[i * d + c] = 0.0f;
      m[i] = -INFINITY, l[i] = 0.0f, pos[i] = src.position + r / group;
    }
  }
  // the keys every source shares, once for all rows; then each source's own, for its rows alone
  const QuerySource& lead = task.sources[0];
  const int64_t k_first = task.window > 0 && lead.position - task.window + 1 > 0 ? lead.position - task.window + 1 : 0;
  attend_range<V, E>(kv, task.kv_head, d, lead.slots, k_first, task.common, 0, rows, pos, task.window, task.softcap,
                     q, acc, s, m, l, kt);
  for (int64_t k = 0, i = 0; k < task.n; ++k) {
    const QuerySource& src = task.sources[k];
    const int64_t end = src.position + src.tokens, own = src.tokens * group;
    if (end > task.common)
      attend_range<V, E>(kv, task.kv_head, d, src.slots, task.common > k_first ? task.common : k_first, end, i,
                         i + own, pos, task.window, task.softcap, q, acc, s, m, l, kt);
    i += own;
  }
  for (int64_t k = 0, i = 0; k < task.n; ++k) {
    const QuerySource& src = task.sources[k];
    for (int64_t r = 0; r < src.tokens * group; ++r, ++i) {
      const int64_t head = task.kv_head * group + r % group;
      float inv = 1.0f / l[i];
      if (task.sinks != nullptr) {  // one more logit, no value: both terms taken against the larger max
        const float sink = task.sinks[head], top = sink > m[i] ? sink : m[i], f = std::exp(m[i] - top);
        inv = f / (l[i] * f + std::exp(sink - top));
      }
      float* dst = x.out + (src.token + r / group) * x.out_stride + head * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = acc[i * d + c] * inv;
    }
  }
}

// attend_sources on the pool's element type
template <class V>
void attend_sources_typed(const QueryLayout& x, const KVLayer& kv, const BlockedTask& task, float* scratch,
                          int64_t* pos) {
  switch (kv.type) {
    case KVType::f16: return attend_sources<V, F16>(x, kv, task, scratch, pos);
    case KVType::bf16: return attend_sources<V, BF16>(x, kv, task, scratch, pos);
    case KVType::i8: return attend_sources<V, I8>(x, kv, task, scratch, pos);
    default: return attend_sources<V, F32>(x, kv, task, scratch, pos);
  }
}

}  // namespace
}  // namespace radixlm
