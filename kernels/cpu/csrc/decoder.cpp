// A decode step's whole decoder stack in one call (torch.classes.radixlm.Decoder): for a batch of
// decode rows (one new token each) on quantized weights, every layer's norm, qkv projection,
// rotary with the K/V store, paged attention, output projection, norm, gate/up projection,
// SiLU-mul and down projection, then the final norm, with no return to Python between them.
//
// It runs the ops' own functions (dispatch.h) in the model's order, so its output is bitwise what
// the same step gives op by op (tested): which path a step takes never changes a token, also
// under --deterministic. The weights and the pool are checked once, when the decoder is made;
// each step's indices once per step, not once per layer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "tensors.h"

namespace radixlm {
namespace {

struct Linear {  // one projection on its tiled codes; the tensors are held so the views stay valid
  at::Tensor tiles, segments, bias;
  TiledMatrix w{};
  const float* b = nullptr;

  Linear() = default;
  // `given`: the rows the model says the projection has
  Linear(const at::Tensor& tiles_, const at::Tensor& segments_, const at::Tensor& bias_, int64_t given, int64_t cols,
         int64_t rows, const char* what)
      : tiles(tiles_), segments(segments_), bias(bias_) {
    RADIXLM_CHECK(given == rows, "radixlm: Decoder: ", what, " must have ", rows, " rows, got ", given);
    w = tiled_matrix(tiles_, segments_, rows, cols);
    if (bias_.defined() && bias_.numel() > 0) {
      RADIXLM_CHECK(bias_.device().is_cpu() && bias_.scalar_type() == at::kFloat && bias_.is_contiguous() &&
                        bias_.numel() == rows,
                    "radixlm: Decoder: ", what, " bias must be a contiguous float32 [", rows, "] CPU tensor, got ",
                    bias_.scalar_type(), " ", bias_.sizes(), " on ", bias_.device().str());
      b = bias_.data_ptr<float>();
    }
  }
};

struct Layer {
  at::Tensor input_norm, post_norm, k_pool, v_pool;
  KVLayer kv{};  // the pools as the kernels read them (any KV type: kv_types.h)
  Linear qkv, o, gate_up, down;
};

const at::Tensor& vector_of(const at::Tensor& t, int64_t n, const char* what) {
  RADIXLM_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n && t.device().is_cpu(),
              "radixlm: Decoder: ", what, " must be float32 [", n, "]");
  return t;
}

}  // namespace

class Decoder : public torch::CustomClassHolder {
 public:
  // Tensors per layer, in this order: input norm; qkv tiles, segments and bias (an empty tensor
  // where the model has none); o tiles and segments; post-attention norm; gate/up tiles and
  // segments; down tiles and segments. Then the final norm. `formats`: per projection (qkv, o,
  // gate/up, down of each layer) its rows.
  static constexpr int64_t kPerLayer = 11;
  static constexpr int64_t kFormat = 1;

  Decoder(std::vector<at::Tensor> weights, std::vector<int64_t> formats, std::vector<at::Tensor> k_pools,
          std::vector<at::Tensor> v_pools, at::Tensor cos2, at::Tensor sin2, int64_t heads, int64_t kv_heads,
          int64_t head_dim, double eps, double scale, int64_t window, bool exact)
      : cos2_(std::move(cos2)), sin2_(std::move(sin2)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        window_(window), eps_(float(eps)), scale_(float(scale)), exact_(exact) {
    RADIXLM_CHECK(window >= 0, "radixlm: Decoder: a window is positive (0: none)");
    const int64_t n_layers = int64_t(k_pools.size());
    RADIXLM_CHECK(n_layers > 0 && int64_t(v_pools.size()) == n_layers && int64_t(weights.size()) == n_layers * kPerLayer + 1 &&
                    int64_t(formats.size()) == n_layers * 4 * kFormat,
                "radixlm: Decoder: ", weights.size(), " weights, ", formats.size(), " format numbers and ", k_pools.size(),
                " / ", v_pools.size(), " pools do not make whole layers");
    RADIXLM_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "radixlm: Decoder: bad head counts");
    check_rows(cos2_, "cos2");
    check_rows(sin2_, "sin2");
    RADIXLM_CHECK(cos2_.size(1) == head_dim && sin2_.sizes() == cos2_.sizes(), "radixlm: Decoder: rotary tables must be [positions, head_dim]");
    hidden_ = weights[0].numel();
    final_norm_ = vector_of(weights.back(), hidden_, "the final norm");
    const int64_t q_size = heads * head_dim, width = (heads + 2 * kv_heads) * head_dim;
    for (int64_t l = 0; l < n_layers; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      const int64_t* f = formats.data() + l * 4 * kFormat;
      Layer layer;
      layer.input_norm = vector_of(w[0], hidden_, "an input norm");
      layer.qkv = Linear(w[1], w[2], w[3], f[0], hidden_, width, "qkv");
      layer.o = Linear(w[4], w[5], at::Tensor(), f[kFormat], q_size, hidden_, "o");
      layer.post_norm = vector_of(w[6], hidden_, "a post-attention norm");
      const int64_t inner2 = f[2 * kFormat];
      RADIXLM_CHECK(inner2 > 0 && inner2 % 2 == 0 && (l == 0 || inner2 == 2 * inner_),
                  "radixlm: Decoder: gate/up needs the same even number of rows in every layer");
      inner_ = inner2 / 2;
      layer.gate_up = Linear(w[7], w[8], at::Tensor(), inner2, hidden_, inner2, "gate/up");
      layer.down = Linear(w[9], w[10], at::Tensor(), f[3 * kFormat], inner_, hidden_, "down");
      layer.kv = kv_layer(k_pools[l], v_pools[l], kv_heads, head_dim);
      RADIXLM_CHECK(k_pools[l].size(1) == k_pools[0].size(1) && k_pools[l].scalar_type() == k_pools[0].scalar_type(),
                  "radixlm: Decoder: every layer's pool must have the same slots and type");
      layer.k_pool = k_pools[l];
      layer.v_pool = v_pools[l];
      layers_.push_back(std::move(layer));
    }
    slots_ = k_pools[0].size(1);
  }

  // h [n, hidden]: the decode rows' embeddings; returns the final norm's output [n, hidden].
  at::Tensor forward(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& out_slots,
                     const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, int64_t isa_level) {
    check_rows(h, "h");
    RADIXLM_CHECK(h.size(1) == hidden_, "radixlm: Decoder: h must have ", hidden_, " columns, got ", h.size(1));
    const int64_t n = h.size(0);
    const Isa isa = resolve_isa(isa_level);
    check_positions(positions, out_slots, n, cos2_.size(0), slots_);
    DecodeRows dr = decode_rows(table, rows, seq_lens, slots_);
    dr.window = window_;
    dr.exact = exact_;
    RADIXLM_CHECK(dr.n == n, "radixlm: Decoder: ", dr.n, " decode rows for ", n, " tokens");
    const int64_t q_size = heads_ * head_dim_, width = (heads_ + 2 * kv_heads_) * head_dim_;
    const auto options = h.options();
    at::Tensor residual = h.clone();
    at::Tensor x = at::empty({n, hidden_}, options), y = at::empty({n, hidden_}, options);
    at::Tensor qkv = at::empty({n, width}, options), attn = at::empty({n, q_size}, options);
    at::Tensor gate_up = at::empty({n, 2 * inner_}, options), act = at::empty({n, inner_}, options);
    const int64_t widest = std::max({hidden_, q_size, inner_});
    at::Tensor q8 = at::empty({n, widest}, options.dtype(at::kShort)), d = at::empty({n, widest / kBlock}, options);
    at::Tensor sums = at::empty({n, widest / kBlock}, options);
    const ActivationBuffer scratch{q8.data_ptr<int16_t>(), d.data_ptr<float>(), sums.data_ptr<float>()};
    float* res = residual.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* attnp = attn.data_ptr<float>();
    float* gup = gate_up.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = out_slots.data_ptr<int64_t>();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      // the first layer normalizes the embeddings; later ones add the last output into the residual first
      rms_norm_into(l == 0 ? res : yp, L.input_norm.data_ptr<float>(), eps_, l == 0 ? nullptr : res, n, hidden_, xp, isa);
      matmul_into(xp, n, L.qkv.w, L.qkv.b, scratch, qkvp, isa);
      rope_store_tokens({qkvp, width, heads_, kv_heads_, head_dim_}, n, pos, cos2_.data_ptr<float>(),
                        sin2_.data_ptr<float>(), L.kv, slot, isa);
      decode_attention_into(qkvp, width, heads_, head_dim_, L.kv, kv_heads_, dr, scale_, attnp, isa);
      matmul_into(attnp, n, L.o.w, L.o.b, scratch, yp, isa);
      rms_norm_into(yp, L.post_norm.data_ptr<float>(), eps_, res, n, hidden_, xp, isa);
      matmul_into(xp, n, L.gate_up.w, nullptr, scratch, gup, isa);
      silu_mul_into(gup, n, inner_, actp, isa);
      matmul_into(actp, n, L.down.w, nullptr, scratch, yp, isa);
    }
    at::Tensor out = at::empty({n, hidden_}, options);
    rms_norm_into(yp, final_norm_.data_ptr<float>(), eps_, res, n, hidden_, out.data_ptr<float>(), isa);
    return out;
  }

 private:
  std::vector<Layer> layers_;
  at::Tensor final_norm_, cos2_, sin2_;
  int64_t heads_, kv_heads_, head_dim_, window_, hidden_ = 0, inner_ = 0, slots_ = 0;
  float eps_, scale_;
  bool exact_;  // decode attention bitwise each row alone (--deterministic), else rows on one prompt may share blocks
};

TORCH_LIBRARY_FRAGMENT(radixlm, m) {
  m.class_<Decoder>("Decoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double, int64_t, bool>())
      .def("forward", &Decoder::forward);
}

}  // namespace radixlm
