// The ops' thread split and ISA choice (dispatch.h).
#include "dispatch.h"

#include <cmath>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

#include "elementwise.h"

namespace radixlm {

namespace {

// Rows of work per thread task: enough that a task is worth a wake-up.
constexpr int64_t kSliceBytes = 128 << 10;  // a matmul's activation rows a task takes at once (quantized)

int64_t grain(int64_t cost_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cost_per_row)); }

using BlockedKernel = void (*)(const QueryLayout&, const KVLayer&, const BlockedTask&, float*, int64_t*);

// The blocked attention kernel of the ISA where it takes the head dimension, else null.
BlockedKernel blocked_kernel(Isa isa, int64_t head_dim) {
  return isa == Isa::avx512 && blocked_avx512_takes(head_dim) ? RADIXLM_VECTOR(attend_sources_avx512)
         : isa >= Isa::avx2 && blocked_avx2_takes(head_dim)    ? RADIXLM_VECTOR(attend_sources_avx2)
                                                               : nullptr;
}

}  // namespace

void quantize_into(const float* x, int64_t rows, int64_t cols, const ActivationBuffer& out, Isa isa) {
  auto run = isa >= Isa::avx2 ? RADIXLM_VECTOR(quantize_rows_avx2) : &quantize_rows_portable;
  const int64_t nb = cols / kBlock;
  at::parallel_for(0, rows, grain(cols), [&](int64_t r0, int64_t r1) {
    run(x + r0 * cols, r1 - r0, cols, out.q + r0 * cols, out.d + r0 * nb, out.sum + r0 * nb);
  });
}

void matmul_into(const float* x, int64_t m, const TiledMatrix& w, const float* bias, const ActivationBuffer& scratch,
                 float* y, Isa isa) {
  quantize_into(x, m, w.cols, scratch, isa);
  const QuantizedActivations xa{scratch.q, scratch.d, scratch.sum, m, w.cols};
  auto run = isa == Isa::avx512 ? RADIXLM_VECTOR(matmul_stream_avx512)
             : isa >= Isa::avx2   ? RADIXLM_VECTOR(matmul_stream_avx2)
                                  : &matmul_stream_portable;
  // A task's row groups against the activations in slices of at most kSliceBytes: each group's
  // tiles are unpacked once per slice, and the slice stays in L2 across the task's groups (at
  // 1,024+ prefill rows the whole activation matrix did not, and the kernel fell 20% behind
  // oneDNN's fp32). Each output is computed by the same instructions either way.
  const int64_t slice = std::max<int64_t>(4, kSliceBytes / (w.cols * int64_t(sizeof(int16_t))) / 4 * 4);
  // One parallel region over every segment's pairs of row groups (the AVX-512 kernel reads two
  // groups side by side): pair p of the matrix is pair p - first[s] of segment s.
  std::vector<int64_t> first{0};
  int64_t bytes = 0;
  for (const Segment& s : w.segments) {
    first.push_back(first.back() + (s.groups() + 1) / 2);
    bytes += TileStream(w.data, s, w.cols).group_bytes() * s.groups();
  }
  const int64_t pairs = first.back(), nb = w.blocks();
  at::parallel_for(0, pairs, grain(bytes / std::max<int64_t>(1, pairs) * std::max<int64_t>(1, m / 4)),
                   [&](int64_t p0, int64_t p1) {
    for (size_t si = 0; si < w.segments.size(); ++si) {
      const int64_t a = std::max(p0, first[si]), b = std::min(p1, first[si + 1]);
      if (a >= b) continue;
      const Segment& s = w.segments[si];
      const TileStream ts(w.data, s, w.cols);
      const int64_t g0 = 2 * (a - first[si]), g1 = std::min(2 * (b - first[si]), ts.groups());
      float* ys = y + s.row0;
      for (int64_t m0 = 0; m0 < m; m0 += slice) {
        const int64_t rows = std::min(slice, m - m0);
        const QuantizedActivations part{xa.q + m0 * w.cols, xa.d + m0 * nb, xa.sum + m0 * nb, rows, w.cols};
        run(part, ts, g0, g1, ys + m0 * w.rows, w.rows);
      }
      if (bias != nullptr)
        for (int64_t r = 0; r < m; ++r)
          for (int64_t n = g0 * kTileRows; n < std::min(g1 * kTileRows, s.rows); ++n)
            ys[r * w.rows + n] += bias[s.row0 + n];
    }
  });
}

void rms_norm_into(const float* x, const float* weight, float eps, float* residual, int64_t rows, int64_t dim,
                   float* out, Isa isa) {
  if (residual != nullptr) {  // residual += x, then normalize the sum
    for (int64_t i = 0; i < rows * dim; ++i) residual[i] += x[i];
    x = residual;
  }
  auto run = isa >= Isa::avx2 ? RADIXLM_VECTOR(rms_norm_rows_avx2) : &rms_norm_rows_portable;
  at::parallel_for(0, rows, grain(dim * 4), [&](int64_t r0, int64_t r1) {
    run(x + r0 * dim, weight, eps, r1 - r0, dim, out + r0 * dim);
  });
}

void silu_mul_into(const float* gate_up, int64_t rows, int64_t inner, float* out, Isa isa) {
  auto run = isa >= Isa::avx2 ? RADIXLM_VECTOR(silu_mul_rows_avx2) : &silu_mul_rows_portable;
  at::parallel_for(0, rows, grain(inner * 8), [&](int64_t r0, int64_t r1) {
    run(gate_up + r0 * 2 * inner, r1 - r0, inner, out + r0 * inner);
  });
}

void rope_store_tokens(const TokenLayout& x, int64_t tokens, const int64_t* positions, const float* cos2,
                       const float* sin2, const KVLayer& kv, const int64_t* out_slots, Isa isa) {
  auto run = isa >= Isa::avx2 ? RADIXLM_VECTOR(rope_store_avx2) : &rope_store_portable;
  at::parallel_for(0, tokens, grain(x.row_stride * 8),
                   [&](int64_t t0, int64_t t1) { run(x, positions, cos2, sin2, kv, out_slots, t0, t1); });
}

namespace {

// The fewest keys rows must share to be attended as a set (below, one block of keys: nothing saved).
constexpr int64_t kMinShared = 64;

struct RowSet {
  std::vector<int64_t> rows;
  int64_t shared;  // the keys (slots) every row of the set begins with; 0 for a row alone
};

// Decode rows grouped by the keys they share: rows whose first kMinShared keys are the same slots
// (the radix cache gives the requests on one prompt the same pages) in sets of at most `most`,
// each set's shared keys those all its rows begin with; every other row a set of its own. (A
// sliding layer's rows each start at their own key: every row alone.)
std::vector<RowSet> row_sets(const DecodeRows& rows, int64_t most) {
  auto slots = [&](int64_t r) { return rows.table + rows.rows[r] * rows.table_cols; };
  std::vector<RowSet> sets;
  std::vector<int64_t> order(rows.n);
  std::iota(order.begin(), order.end(), 0);
  if (rows.window > 0) {
    for (int64_t r : order) sets.push_back({{r}, 0});
    return sets;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slots(a)[0] < slots(b)[0]; });
  for (int64_t i = 0; i < rows.n;) {
    const int64_t lead = order[i];
    std::vector<int64_t> with{lead}, alone;
    int64_t shared = rows.seq_lens[lead], j = i + 1;
    for (; j < rows.n && slots(order[j])[0] == slots(lead)[0]; ++j) {
      const int64_t r = order[j], limit = std::min(rows.seq_lens[lead], rows.seq_lens[r]);
      int64_t common = 0;
      while (common < limit && slots(r)[common] == slots(lead)[common]) ++common;
      if (common >= kMinShared) {
        with.push_back(r);
        shared = std::min(shared, common);
      } else {
        alone.push_back(r);
      }
    }
    if (with.size() == 1) alone.push_back(lead);
    for (size_t k = 0; with.size() > 1 && k < with.size(); k += most)
      sets.push_back({{with.begin() + k, with.begin() + std::min(with.size(), k + size_t(most))}, shared});
    for (int64_t r : alone) sets.push_back({{r}, 0});
    i = j;
  }
  return sets;
}

}  // namespace

void decode_attention_into(const float* q, int64_t q_stride, int64_t heads, int64_t head_dim, const KVLayer& kv,
                           int64_t kv_heads, const DecodeRows& rows, float scale, float* out, Isa isa) {
  auto run = isa >= Isa::avx2 ? RADIXLM_VECTOR(decode_head_avx2) : &decode_head_portable;
  const int64_t group = heads / kv_heads;
  // row r's keys: the last `window` where a sliding layer has one
  auto first_key = [&](int64_t r) { return rows.window > 0 ? std::max<int64_t>(0, rows.seq_lens[r] - rows.window) : 0; };
  // the logits of query heads from `first` on (their sinks)
  auto logits = [&](int64_t first) { return Logits{scale, rows.softcap, rows.sinks ? rows.sinks + first : nullptr}; };
  const int64_t longest = rows.window > 0 ? std::min(rows.longest, rows.window) : rows.longest;
#if RADIXLM_X86
  // With enough rows, one task per (row, KV head): the group's query heads read each key and
  // value once (GQA: SmolLM2's 3 heads a KV head read the pool a third as often); rows on one
  // cached prompt go in sets whose task reads the prompt's keys once for all its rows (16 rows
  // under a 1k-token system prompt read it twice, not 16 times). With few rows, one task per
  // (row, query head), so the threads share the work evenly (a lone decode row's 9 heads split
  // 5:4 over two threads, its 3 KV heads 2:1). Every way gives each head bitwise the same output.
  const int64_t threads = at::get_num_threads();
  if (isa >= Isa::avx2 && group > 1 && decode_group_takes(group, head_dim) && rows.n * kv_heads >= 2 * threads) {
    const std::vector<RowSet> sets = row_sets(rows, std::clamp<int64_t>(rows.n * kv_heads / (2 * threads), 2, 8));
    const BlockedKernel blocked = rows.exact ? nullptr : blocked_kernel(isa, head_dim);
    const QueryLayout layout{q, q_stride, out, heads * head_dim, heads, kv_heads, head_dim, scale};
    at::parallel_for(0, int64_t(sets.size()) * kv_heads, 1, [&](int64_t a, int64_t b) {
      std::vector<float> scratch;
      std::vector<const float*> qs;
      std::vector<const int64_t*> keys;
      std::vector<int64_t> lens, positions;
      std::vector<float*> outs;
      std::vector<QuerySource> sources;
      for (int64_t task = a; task < b; ++task) {
        const RowSet& set = sets[task / kv_heads];
        const int64_t h = task % kv_heads, first = h * group, n = int64_t(set.rows.size());
        if (n > 1 && blocked != nullptr) {  // not bitwise each row alone: the set's rows share the key blocks' packing
          sources.clear();
          for (int64_t r : set.rows)
            sources.push_back({r, 1, rows.seq_lens[r] - 1, rows.table + rows.rows[r] * rows.table_cols});
          scratch.resize(blocked_scratch_floats(n * group, head_dim));
          positions.resize(n * group);
          blocked(layout, kv, {sources.data(), n, h, set.shared, 0, rows.softcap, rows.sinks}, scratch.data(),
                  positions.data());
          continue;
        }
        if (n == 1) {
          const int64_t r = set.rows[0], start = first_key(r);
          scratch.resize(group * longest);
          decode_group_avx2(q + r * q_stride + first * head_dim, group, head_dim, kv, h,
                            rows.table + rows.rows[r] * rows.table_cols + start, rows.seq_lens[r] - start,
                            logits(first), scratch.data(), out + (r * heads + first) * head_dim);
          continue;
        }
        qs.clear(), keys.clear(), lens.clear(), outs.clear();
        int64_t total = 0;
        for (int64_t r : set.rows) {
          qs.push_back(q + r * q_stride + first * head_dim);
          keys.push_back(rows.table + rows.rows[r] * rows.table_cols);
          lens.push_back(rows.seq_lens[r]);
          outs.push_back(out + (r * heads + first) * head_dim);
          total += rows.seq_lens[r];
        }
        scratch.resize(group * (total + int64_t(set.rows.size()) * head_dim));
        const SharedRows shared{qs.data(), keys.data(), lens.data(), outs.data(), int64_t(set.rows.size()), set.shared};
        decode_shared_avx2(shared, group, head_dim, kv, h, logits(first), scratch.data());
      }
    });
    return;
  }
#endif
  // one task per (row, query head), its keys in key order
  at::parallel_for(0, rows.n * heads, 1, [&](int64_t a, int64_t b) {
    std::vector<float> scores(longest);
    for (int64_t task = a; task < b; ++task) {
      const int64_t r = task / heads, h = task % heads, start = first_key(r);
      run(q + r * q_stride + h * head_dim, head_dim, kv, h / group, rows.table + rows.rows[r] * rows.table_cols + start,
          rows.seq_lens[r] - start, logits(h), scores.data(), out + (r * heads + h) * head_dim);
    }
  });
}

namespace {

// One extend task: tokens [t0, t1) of extend row `row`, the query heads of KV head `kv_head`.
struct ExtendTask {
  int64_t row, kv_head, t0, t1;
};

// Query rows (tokens x query heads of a KV head) an extend task takes at most: its scores and
// values stay in L2 beside a block of keys. Fewer where that would leave under kTasksPerThread
// tasks a thread to balance (one 64-token row of SmolLM2 is 3 such tasks: 2:1 on two threads),
// but never under kMinRows (the score kernel's registers hold 12).
constexpr int64_t kExtendRows = 96, kMinRows = 16, kTasksPerThread = 4;

std::vector<ExtendTask> extend_tasks(const ExtendRows& rows, int64_t kv_heads, int64_t group) {
  int64_t total = 0;
  for (int64_t r = 0; r < rows.n; ++r) total += rows.extend_lens[r];
  const int64_t wanted = (total * kv_heads + kTasksPerThread * at::get_num_threads() - 1) /
                         (kTasksPerThread * at::get_num_threads());  // tokens a task for enough tasks
  const int64_t tokens = std::clamp(wanted, (kMinRows + group - 1) / group, std::max<int64_t>(1, kExtendRows / group));
  std::vector<ExtendTask> tasks;
  for (int64_t r = 0; r < rows.n; ++r)
    for (int64_t t0 = 0; t0 < rows.extend_lens[r]; t0 += tokens)
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({r, h, t0, std::min(t0 + tokens, rows.extend_lens[r])});
  auto cost = [&](const ExtendTask& t) {  // query rows x the keys its last token sees
    const int64_t last = rows.prefix_lens[t.row] + t.t1;
    return (t.t1 - t.t0) * (rows.window > 0 ? std::min(last, rows.window + t.t1 - t.t0) : last);
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const ExtendTask& a, const ExtendTask& b) { return cost(a) > cost(b); });
  return tasks;
}

}  // namespace

void extend_attention_into(const QueryLayout& x, const KVLayer& kv, const ExtendRows& rows, Isa isa) {
  const int64_t group = x.heads / x.kv_heads, d = x.head_dim;
  const BlockedKernel run = blocked_kernel(isa, d);
  if (run == nullptr) {  // the decode kernel for each (token, query head), over its keys in order
    std::vector<int64_t> token_row;
    for (int64_t r = 0; r < rows.n; ++r) token_row.insert(token_row.end(), rows.extend_lens[r], r);
    const int64_t tokens = int64_t(token_row.size());
    at::parallel_for(0, tokens * x.heads, 1, [&](int64_t a, int64_t b) {
      std::vector<float> scores;
      for (int64_t task = a; task < b; ++task) {
        const int64_t t = task / x.heads, h = task % x.heads, r = token_row[t];
        const int64_t token = t - rows.token_starts[r], pos = rows.prefix_lens[r] + token;
        const int64_t start = rows.window > 0 ? std::max<int64_t>(0, pos + 1 - rows.window) : 0;
        scores.resize(pos + 1 - start);
        decode_head_portable(x.q + t * x.q_stride + h * d, d, kv, h / group,
                             rows.table + rows.rows[r] * rows.table_cols + start, pos + 1 - start,
                             {x.scale, rows.softcap, rows.sinks ? rows.sinks + h : nullptr}, scores.data(),
                             x.out + t * x.out_stride + h * d);
      }
    });
    return;
  }
  const std::vector<ExtendTask> tasks = extend_tasks(rows, x.kv_heads, group);
  const int64_t most_rows = std::max<int64_t>(1, kExtendRows / group) * group;
  std::atomic<int64_t> next{0};  // the costliest first, to whichever thread is free
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(blocked_scratch_floats(most_rows, d));
    std::vector<int64_t> positions(most_rows);
    for (int64_t i = next++; i < int64_t(tasks.size()); i = next++) {
      const ExtendTask& t = tasks[i];
      const int64_t prefix = rows.prefix_lens[t.row];
      const QuerySource source{rows.token_starts[t.row] + t.t0, t.t1 - t.t0, prefix + t.t0,
                               rows.table + rows.rows[t.row] * rows.table_cols};
      run(x, kv, {&source, 1, t.kv_head, prefix + t.t1, rows.window, rows.softcap, rows.sinks}, scratch.data(),
          positions.data());
    }
  });
}

}  // namespace radixlm
