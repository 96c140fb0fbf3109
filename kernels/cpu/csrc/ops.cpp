// The library's torch ops (torch.ops.radixlm.*): the ISA chosen once, and each op's argument
// checks before it runs (dispatch.cpp splits the work across threads; the kernels themselves live
// in the *_portable and *_avx2 files).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "repack.h"
#include "tensors.h"

namespace radixlm {

namespace {

Isa cpu_best() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return avx2 && avx512 ? Isa::avx512 : avx2 ? Isa::avx2 : Isa::portable;
#else
  return Isa::portable;
#endif
}

}  // namespace

Isa best_isa() {
  static const Isa best = cpu_best();
  return best;
}

Isa resolve_isa(int64_t requested) {
  if (requested < 0) return best_isa();
  RADIXLM_CHECK(requested <= int64_t(best_isa()), "radixlm: ISA level ", requested, " is not supported by this CPU (best: ",
              int64_t(best_isa()), ")");
  return Isa(requested);
}

void check_rows(const at::Tensor& x, const char* what) {
  RADIXLM_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "radixlm: ",
              what, " must be a contiguous 2-D float32 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
}

TiledMatrix tiled_matrix(const at::Tensor& tiles, const at::Tensor& segments, int64_t rows, int64_t cols) {
  RADIXLM_CHECK(rows > 0 && cols > 0 && cols % kBlock == 0, "radixlm: a tiled matrix needs rows and a multiple of ", kBlock,
                " columns, got ", rows, " x ", cols);
  RADIXLM_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 1,
                "radixlm: tiles must be a contiguous uint8 CPU vector, got ", tiles.scalar_type(), " ", tiles.sizes());
  RADIXLM_CHECK(segments.device().is_cpu() && segments.scalar_type() == at::kLong && segments.is_contiguous() &&
                    segments.dim() == 2 && segments.size(1) == 5 && segments.size(0) > 0,
                "radixlm: segments must be a contiguous int64 [n, 5] CPU tensor (row0, rows, offset, kind, wide), got ",
                segments.sizes());
  TiledMatrix w;
  w.data = tiles.data_ptr<uint8_t>();
  w.rows = rows;
  w.cols = cols;
  const int64_t* s = segments.data_ptr<int64_t>();
  int64_t next_row = 0;
  for (int64_t i = 0; i < segments.size(0); ++i, s += 5) {
    RADIXLM_CHECK(s[3] >= 0 && s[3] < kCodeKinds && (s[4] == 0 || s[4] == 1), "radixlm: segment ", i,
                  " names no format (kind ", s[3], ")");
    const Segment seg{s[0], s[1], s[2], Codes(s[3]), s[4] != 0};
    RADIXLM_CHECK(seg.row0 == next_row && seg.rows > 0 && seg.row0 + seg.rows <= rows,
                  "radixlm: segment ", i, " must hold the rows after the last one's, within the matrix's ", rows);
    RADIXLM_CHECK(!is_k(seg.kind) || w.blocks() % kSuperBlocks == 0, "radixlm: a K-quant segment needs a multiple of ",
                  kSuperBlocks * kBlock, " columns, got ", cols);
    RADIXLM_CHECK(seg.offset >= 0 && seg.offset + segment_bytes(seg.kind, seg.wide, seg.rows, cols) <= tiles.numel(),
                  "radixlm: segment ", i, " runs past the tiles' ", tiles.numel(), " bytes");
    next_row += seg.rows;
    w.segments.push_back(seg);
  }
  RADIXLM_CHECK(next_row == rows, "radixlm: the segments hold ", next_row, " rows of a matrix of ", rows);
  return w;
}

namespace {

std::optional<KVType> kv_type(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return KVType::f32;
    case at::kHalf: return KVType::f16;
    case at::kBFloat16: return KVType::bf16;
    case at::kChar: return KVType::i8;
    default: return std::nullopt;
  }
}

void check_pool(const at::Tensor& pool, int64_t kv_heads, int64_t head_dim, const char* what) {
  const std::optional<KVType> type = kv_type(pool.scalar_type());
  const int64_t row = type ? kv_row(*type, head_dim) : head_dim;
  RADIXLM_CHECK(type && pool.device().is_cpu() && pool.is_contiguous() && pool.dim() == 3 && pool.size(0) == kv_heads &&
                    pool.size(2) == row,
                "radixlm: ", what, " must be a contiguous float32, float16 or bfloat16 [", kv_heads, ", slots, ",
                head_dim, "] or int8 [", kv_heads, ", slots, ", head_dim, " + 4] CPU tensor, got ", pool.scalar_type(),
                " ", pool.sizes());
}

}  // namespace

int64_t pool_head_dim(const at::Tensor& pool) {
  const std::optional<KVType> type = kv_type(pool.scalar_type());
  if (!type || pool.dim() != 3) return 0;
  return *type == KVType::i8 ? pool.size(2) - 4 : pool.size(2);
}

KVLayer kv_layer(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t kv_heads, int64_t head_dim) {
  check_pool(k_pool, kv_heads, head_dim, "k_pool");
  check_pool(v_pool, kv_heads, head_dim, "v_pool");
  RADIXLM_CHECK(v_pool.scalar_type() == k_pool.scalar_type() && v_pool.sizes() == k_pool.sizes(),
                "radixlm: k_pool and v_pool must be of one type and shape, got ", k_pool.scalar_type(), " ",
                k_pool.sizes(), " and ", v_pool.scalar_type(), " ", v_pool.sizes());
  return {k_pool.data_ptr(), v_pool.data_ptr(), k_pool.size(1), head_dim, *kv_type(k_pool.scalar_type())};
}

void check_index(const at::Tensor& t, int64_t n, const char* what) {
  RADIXLM_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) >= n,
              "radixlm: ", what, " must be a contiguous int64 CPU vector of at least ", n, " entries");
}

void check_positions(const at::Tensor& positions, const at::Tensor& out_slots, int64_t tokens, int64_t table_positions,
                     int64_t slots) {
  check_index(positions, tokens, "positions");
  check_index(out_slots, tokens, "out_slots");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = out_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // a bad index is a bug upstream, but never a write out of bounds
    RADIXLM_CHECK(pos[t] >= 0 && pos[t] < table_positions, "radixlm: position ", pos[t], " outside the rotary tables");
    RADIXLM_CHECK(slot[t] >= 0 && slot[t] < slots, "radixlm: KV slot ", slot[t], " outside the pool");
  }
}

DecodeRows decode_rows(const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, int64_t slots) {
  const int64_t n = rows.numel();
  check_index(rows, n, "rows");
  check_index(seq_lens, n, "seq_lens");
  RADIXLM_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2,
              "radixlm: the token table must be a contiguous int64 matrix");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t cols = table.size(1);
  int64_t longest = 1;
  for (int64_t r = 0; r < n; ++r) {
    RADIXLM_CHECK(row[r] >= 0 && row[r] < table.size(0) && lens[r] > 0 && lens[r] <= cols,
                "radixlm: decode row ", r, " has no valid token-table row or length");
    for (int64_t j = 0; j < lens[r]; ++j)
      RADIXLM_CHECK(tab[row[r] * cols + j] >= 0 && tab[row[r] * cols + j] < slots,
                  "radixlm: a token-table slot lies outside the pool");
    longest = std::max(longest, lens[r]);
  }
  return {tab, cols, row, lens, n, longest};
}

namespace {

struct Activations {  // quantized activations' storage
  at::Tensor q, d, sum;
  Activations(int64_t rows, int64_t cols, const at::TensorOptions& options)
      : q(at::empty({rows, cols}, options.dtype(at::kShort))),
        d(at::empty({rows, cols / kBlock}, options)),
        sum(at::empty({rows, cols / kBlock}, options)) {}
  ActivationBuffer buffer() const { return {q.data_ptr<int16_t>(), d.data_ptr<float>(), sum.data_ptr<float>()}; }
};

void check_blocks(const at::Tensor& x) {
  check_rows(x, "x");
  RADIXLM_CHECK(x.size(1) % kBlock == 0, "radixlm: activations need a multiple of ", kBlock, " columns, got ", x.size(1));
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& segments, int64_t rows,
                        int64_t isa_level) {
  check_blocks(x);
  const Isa isa = resolve_isa(isa_level);
  const TiledMatrix w = tiled_matrix(tiles, segments, rows, x.size(1));
  const Activations scratch(x.size(0), x.size(1), x.options());
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  matmul_into(x.data_ptr<float>(), x.size(0), w, nullptr, scratch.buffer(), y.data_ptr<float>(), isa);
  return y;
}

at::Tensor dequantize_rows_op(const at::Tensor& tiles, const at::Tensor& segments, const at::Tensor& ids, int64_t rows,
                              int64_t cols) {
  const TiledMatrix w = tiled_matrix(tiles, segments, rows, cols);
  RADIXLM_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "radixlm: row ids must be an int64 CPU tensor");
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    RADIXLM_CHECK(id[i] >= 0 && id[i] < rows, "radixlm: row ", id[i], " outside a matrix of ", rows, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(cols);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, flat.numel(), 64, [&](int64_t a, int64_t b) { dequantize_rows(w, id + a, b - a, dst + a * cols); });
  return out;
}

// A matrix's tiles from its parts' file blocks (repack.h), rows in order: part i's rows are
// sources[i]'s rows row_ids[i] (-1: a row of zeros), each source row its blocks' bytes for the
// matrix's columns, in format formats[i]. Consecutive parts of one format make one segment.
// Returns (tiles, segments) as quant_matmul takes them.
std::tuple<at::Tensor, at::Tensor> pack(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& row_ids,
                                        const std::vector<int64_t>& formats, int64_t cols) {
  RADIXLM_CHECK(!sources.empty() && sources.size() == row_ids.size() && sources.size() == formats.size(),
                "radixlm: pack needs one row index and one format per source, and at least one source");
  RADIXLM_CHECK(cols > 0 && cols % kBlock == 0, "radixlm: pack needs a multiple of ", kBlock, " columns, got ", cols);
  struct Run {
    Source format;
    std::vector<const uint8_t*> rows;
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < sources.size(); ++i) {
    RADIXLM_CHECK(formats[i] >= 0 && formats[i] < kSources, "radixlm: pack: part ", i, " names no block format (",
                  formats[i], ")");
    const Source f = Source(formats[i]);
    const at::Tensor& src = sources[i];
    const at::Tensor& ids = row_ids[i];
    const int64_t need = cols / source_block_cols(f) * source_block_bytes(f);
    RADIXLM_CHECK(cols % source_block_cols(f) == 0, "radixlm: pack: part ", i, "'s blocks of ", source_block_cols(f),
                  " columns do not make ", cols);
    RADIXLM_CHECK(src.device().is_cpu() && src.scalar_type() == at::kByte && src.dim() == 2 && src.stride(1) == 1 &&
                      src.size(1) >= need,
                  "radixlm: pack: part ", i, " must be uint8 [rows, >= ", need, " bytes] with contiguous rows, got ",
                  src.sizes());
    RADIXLM_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
                  "radixlm: pack: row ids must be contiguous int64 vectors");
    if (runs.empty() || runs.back().format != f) runs.push_back({f, {}});
    const uint8_t* base = src.data_ptr<uint8_t>();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t r = 0; r < ids.numel(); ++r) {
      RADIXLM_CHECK(id[r] >= -1 && id[r] < src.size(0), "radixlm: pack: row ", id[r], " outside part ", i, "'s ",
                    src.size(0), " rows");
      runs.back().rows.push_back(id[r] < 0 ? nullptr : base + id[r] * src.stride(0));
    }
  }
  at::Tensor segments = at::empty({int64_t(runs.size()), 5}, at::TensorOptions().dtype(at::kLong));
  int64_t* seg = segments.data_ptr<int64_t>();
  int64_t row0 = 0, bytes = 0;
  for (const Run& run : runs) {
    bool wide = false;
    const Codes kind = source_codes(run.format, &wide);
    const int64_t rows = int64_t(run.rows.size());
    RADIXLM_CHECK(rows > 0, "radixlm: pack: a part with no rows");
    *seg++ = row0, *seg++ = rows, *seg++ = bytes, *seg++ = int64_t(kind), *seg++ = wide;
    row0 += rows;
    bytes += segment_bytes(kind, wide, rows, cols);
  }
  at::Tensor tiles = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  for (size_t i = 0; i < runs.size(); ++i)
    repack_rows(runs[i].format, runs[i].rows.data(), int64_t(runs[i].rows.size()), cols,
                tiles.data_ptr<uint8_t>() + segments[int64_t(i)][2].item<int64_t>());
  return {tiles, segments};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, int64_t isa_level) {
  check_blocks(x);
  const Activations a(x.size(0), x.size(1), x.options());
  quantize_into(x.data_ptr<float>(), x.size(0), x.size(1), a.buffer(), resolve_isa(isa_level));
  // back from pair order (an exchange of columns, its own inverse) to column order
  at::Tensor q = at::empty(a.q.sizes(), a.q.options());
  const int16_t* src = a.q.data_ptr<int16_t>();
  int16_t* dst = q.data_ptr<int16_t>();
  for (int64_t i = 0; i < q.numel(); ++i) dst[i] = src[pair_order(i)];
  return {q, a.d, a.sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual,
                    int64_t isa_level) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), dim = x.size(1);
  RADIXLM_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                    weight.numel() == dim,
                "radixlm: rms_norm weight must be a contiguous float32 [", dim, "] CPU tensor, got ",
                weight.scalar_type(), " ", weight.sizes(), " on ", weight.device().str());
  float* res = nullptr;
  if (residual.has_value() && residual->defined()) {
    check_rows(*residual, "residual");
    RADIXLM_CHECK(residual->sizes() == x.sizes(), "radixlm: residual must be shaped like x");
    res = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_into(x.data_ptr<float>(), weight.data_ptr<float>(), float(eps), res, rows, dim, out.data_ptr<float>(),
                resolve_isa(isa_level));
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t isa_level) {
  check_rows(gate_up, "gate_up");
  RADIXLM_CHECK(gate_up.size(1) % 2 == 0, "radixlm: silu_mul needs an even number of columns (gate, then up)");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  silu_mul_into(gate_up.data_ptr<float>(), rows, inner, out.data_ptr<float>(), resolve_isa(isa_level));
  return out;
}

TokenLayout token_layout(const at::Tensor& qkv, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t width = qkv.size(1);
  RADIXLM_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && width % (heads + 2 * kv_heads) == 0,
              "radixlm: qkv rows of ", width, " columns do not hold ", heads, " query and 2 x ", kv_heads, " KV heads");
  return {qkv.data_ptr<float>(), width, heads, kv_heads, width / (heads + 2 * kv_heads)};
}

void check_tables(const at::Tensor& cos2, const at::Tensor& sin2, int64_t head_dim) {
  check_rows(cos2, "cos2");
  check_rows(sin2, "sin2");
  RADIXLM_CHECK(cos2.size(1) == head_dim && sin2.sizes() == cos2.sizes(), "radixlm: rotary tables must be [positions, head_dim]");
  RADIXLM_CHECK(head_dim % 2 == 0, "radixlm: rotary needs an even head_dim");
}

void rope_store(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos2, const at::Tensor& sin2,
                at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& out_slots, int64_t heads, int64_t kv_heads,
                int64_t isa_level) {
  const TokenLayout x = token_layout(qkv, heads, kv_heads);
  check_tables(cos2, sin2, x.head_dim);
  const KVLayer kv = kv_layer(k_pool, v_pool, kv_heads, x.head_dim);
  const int64_t tokens = qkv.size(0);
  check_positions(positions, out_slots, tokens, cos2.size(0), kv.slots);
  rope_store_tokens(x, tokens, positions.data_ptr<int64_t>(), cos2.data_ptr<float>(), sin2.data_ptr<float>(), kv,
                    out_slots.data_ptr<int64_t>(), resolve_isa(isa_level));
}

// An attention op's q (rows of whole query heads, strided) and pools: their dimensions, checked

// gpt-oss's sinks: one logit per query head, or none.
const float* sink_logits(const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  RADIXLM_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == heads && sinks->is_contiguous(),
                "radixlm: sinks must be a contiguous float32 CPU tensor of one logit per query head (", heads, ")");
  return sinks->data_ptr<float>();
}

// (and the layer's pools as the kernels read them)
struct AttentionShape {
  int64_t heads, kv_heads, head_dim;
  KVLayer kv;
};

AttentionShape attention_shape(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  RADIXLM_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 2 && q.stride(1) == 1,
                "radixlm: q must be a float32 [rows, heads * head_dim] CPU tensor with contiguous rows");
  const int64_t kv_heads = k_pool.dim() == 3 ? k_pool.size(0) : 0, d = pool_head_dim(k_pool);
  RADIXLM_CHECK(d > 0 && kv_heads > 0 && q.size(1) % d == 0 && (q.size(1) / d) % kv_heads == 0,
                "radixlm: q's ", q.size(1), " columns are not whole query heads of k_pool's ", kv_heads, " x ", d,
                k_pool.scalar_type() == at::kChar ? " (an int8 pool's rows: head_dim codes, then a 4-byte scale)" : "");
  return {q.size(1) / d, kv_heads, d, kv_layer(k_pool, v_pool, kv_heads, d)};
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, double scale,
                            int64_t isa_level, int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                            bool exact) {
  RADIXLM_CHECK(window >= 0 && softcap >= 0, "radixlm: a window and a soft cap are positive (0: none)");
  const auto [heads, kv_heads, d, kv] = attention_shape(q, k_pool, v_pool);
  DecodeRows dr = decode_rows(table, rows, seq_lens, kv.slots);
  dr.window = window;
  dr.softcap = float(softcap);
  dr.sinks = sink_logits(sinks, heads);
  dr.exact = exact;
  RADIXLM_CHECK(dr.n <= q.size(0), "radixlm: more decode rows than q rows");
  at::Tensor out = at::empty({dr.n, heads * d}, q.options());
  decode_attention_into(q.data_ptr<float>(), q.stride(0), heads, d, kv, kv_heads, dr, float(scale), out.data_ptr<float>(),
                        resolve_isa(isa_level));
  return out;
}

void extend_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                      const at::Tensor& rows, const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                      at::Tensor& out, int64_t isa_level, int64_t window, double softcap,
                      const std::optional<at::Tensor>& sinks) {
  RADIXLM_CHECK(window >= 0 && softcap >= 0, "radixlm: a window and a soft cap are positive (0: none)");
  const AttentionShape shape = attention_shape(q, k_pool, v_pool);
  const int64_t n = rows.numel(), slots = k_pool.size(1);
  check_index(rows, n, "rows");
  check_index(prefix_lens, n, "prefix_lens");
  check_index(extend_lens, n, "extend_lens");
  RADIXLM_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2,
                "radixlm: the token table must be a contiguous int64 matrix");
  const int64_t *row = rows.data_ptr<int64_t>(), *prefix = prefix_lens.data_ptr<int64_t>(),
                *ext = extend_lens.data_ptr<int64_t>(), *tab = table.data_ptr<int64_t>();
  const int64_t cols = table.size(1);
  std::vector<int64_t> starts(n);
  int64_t tokens = 0;
  for (int64_t r = 0; r < n; ++r) {
    RADIXLM_CHECK(row[r] >= 0 && row[r] < table.size(0) && prefix[r] >= 0 && ext[r] > 0 && prefix[r] + ext[r] <= cols,
                  "radixlm: extend row ", r, " has no valid token-table row, prefix or length");
    const int64_t first = window > 0 ? std::max<int64_t>(0, prefix[r] + 1 - window) : 0;
    for (int64_t j = first; j < prefix[r] + ext[r]; ++j)  // every key a token of the row reads
      RADIXLM_CHECK(tab[row[r] * cols + j] >= 0 && tab[row[r] * cols + j] < slots,
                    "radixlm: a token-table slot lies outside the pool");
    starts[r] = tokens;
    tokens += ext[r];
  }
  RADIXLM_CHECK(q.size(0) == tokens, "radixlm: q has ", q.size(0), " rows for the extend rows' ", tokens, " tokens");
  RADIXLM_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                    out.size(0) == tokens && out.size(1) == q.size(1),
                "radixlm: out must be a float32 [", tokens, ", ", q.size(1), "] CPU tensor with contiguous rows");
  const ExtendRows er{tab, cols, row, prefix, ext, starts.data(), n, window, float(softcap),
                      sink_logits(sinks, shape.heads)};
  const QueryLayout x{q.data_ptr<float>(), q.stride(0), out.data_ptr<float>(), out.stride(0), shape.heads,
                      shape.kv_heads, shape.head_dim, float(scale)};
  extend_attention_into(x, shape.kv, er, resolve_isa(isa_level));
}

int64_t best_isa_level() { return int64_t(best_isa()); }

}  // namespace

TORCH_LIBRARY(radixlm, m) {
  m.def("best_isa() -> int", &best_isa_level);
  m.def("dequantize_rows(Tensor tiles, Tensor segments, Tensor ids, int rows, int cols) -> Tensor", &dequantize_rows_op);
  m.def("pack(Tensor[] sources, Tensor[] row_ids, int[] formats, int cols) -> (Tensor, Tensor)", &pack);
  m.def("quantize_activations(Tensor x, int isa=-1) -> (Tensor, Tensor, Tensor)", &quantize_activations);
  m.def("quant_matmul(Tensor x, Tensor tiles, Tensor segments, int rows, int isa=-1) -> Tensor", &quant_matmul);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None, int isa=-1) -> Tensor", &rms_norm);
  m.def("silu_mul(Tensor gate_up, int isa=-1) -> Tensor", &silu_mul);
  m.def("rope_store(Tensor(a!) qkv, Tensor positions, Tensor cos2, Tensor sin2, Tensor(b!) k_pool, Tensor(c!) v_pool, "
        "Tensor out_slots, int heads, int kv_heads, int isa=-1) -> ()", &rope_store);
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor rows, Tensor seq_lens, "
        "float scale, int isa=-1, int window=0, float softcap=0., Tensor? sinks=None, bool exact=True) -> Tensor",
        &decode_attention);
  m.def("extend_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor rows, Tensor prefix_lens, "
        "Tensor extend_lens, float scale, Tensor(a!) out, int isa=-1, int window=0, float softcap=0., "
        "Tensor? sinks=None) -> ()", &extend_attention);
}

}  // namespace radixlm
