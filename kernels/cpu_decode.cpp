// A Llama decoder's layers for a decode step of 1-4 rows on a CPU, in one C++ call (issue 42).
//
// Why: at batch 1 a SmolLM2 step reads 538 MB of float32 weights (135 MB in INT8), which the
// few-row kernels stream at ~90% of a plain sum's speed. Run as 30 compiled Inductor graphs, one
// per layer, the step spent ~100 us a layer besides them: Dynamo's guards and frame, AOTAutograd's
// wrappers, Inductor's Python wrapper and five op calls (py-spy: 3-4 ms of a 24 ms step). Here
// the whole stack of layers is one loop: RMSNorm with the residual add, the fused QKV projection,
// rotary (rotate-half), the K/V write into the block-major pages, paged GQA attention over each
// row's own context, the output projection, the second norm, SiLU-and-mul and the down
// projection; the token lookup before the layers and the final norm after them are in the call
// too. The arithmetic is the eager model's: float32 math, the same kernels for the
// linears, softmax with the row max subtracted; a bfloat16 model's activations are rounded to
// bfloat16 wherever the eager model stores one (sums, norms, projections, rotary, SiLU).
//
// Rows are what decode_graph.py makes of a step: a decode token, or one verification token with
// its own position and table row (its context: the tokens up to and including it). Pages are
// [blocks, 2, block_size, Hk, D] in the model's dtype with K and V rows of Hk * D values
// (graph_ops.fits).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_attention.h"
#include "cpu_gemv.h"

namespace {

// each float to the nearest bfloat16 (ties to even), kept as a float; NaN-free inputs
void round_bf16(float* p, int64_t n) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i b = _mm256_castps_si256(_mm256_loadu_ps(p + i));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    b = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(bias, odd)), high);
    _mm256_storeu_ps(p + i, _mm256_castsi256_ps(b));
  }
  for (; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));
}

// one projection: a column-major float32 weight, a row-major bfloat16 one, or INT8 rows with a
// scale per output channel (and SmoothQuant's inverse smoothing of x, where the checkpoint has it)
struct Projection {
  torch::Tensor weight;
  std::optional<torch::Tensor> scale, inv_smooth, bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (weight.scalar_type() == at::kBFloat16) {  // as the eager layer: y, then y + bias, rounded
      auto y = bf16_gemv(x, weight);
      round_bf16(y.data_ptr<float>(), y.numel());
      if (bias) {
        y.add_(*bias);
        round_bf16(y.data_ptr<float>(), y.numel());
      }
      return y;
    }
    if (weight.scalar_type() == at::kChar) {
      auto y = int8_gemv(inv_smooth ? (x * *inv_smooth).contiguous() : x, weight, *scale);
      return bias ? y.add_(*bias) : y;
    }
    return cpu_f32_linear(x, weight, bias);  // the op eager layers call: the same sums
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm, pages;
  Projection qkv, o, gate_up, down;
};

// residual += h; out = rmsnorm(residual) * weight, per row (HF LlamaRMSNorm in float32; in
// bfloat16 the sum, the normed row and the product are each rounded, as the eager model's)
void add_and_norm(float* residual, const float* h, const float* weight, float* out, int64_t rows,
                  int64_t width, float eps, bool bf16) {
  for (int64_t b = 0; b < rows; ++b) {
    float* s = residual + b * width;
    const float* x = h + b * width;
    for (int64_t i = 0; i < width; ++i) s[i] += x[i];
    if (bf16) round_bf16(s, width);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
      const __m256 v = _mm256_loadu_ps(s + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sq = hsum(acc);
    for (; i < width; ++i) sq += s[i] * s[i];
    const float inv = 1.0f / std::sqrt(sq / float(width) + eps);
    float* o = out + b * width;
    for (int64_t j = 0; j < width; ++j) o[j] = s[j] * inv;
    if (bf16) round_bf16(o, width);
    for (int64_t j = 0; j < width; ++j) o[j] *= weight[j];
    if (bf16) round_bf16(o, width);
  }
}

// rotate-half rotary of `heads` vectors of d values at x, to position p's cos/sin row; each
// product rounded before the sum, as torch's separate ops round them (no fused multiply-add)
__attribute__((optimize("fp-contract=off"))) void rotate(float* x, int64_t heads, int64_t d,
                                                        const float* cos_sin) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* v = x + hd * d;
    for (int64_t i = 0; i < half; ++i) {
      const float c = cos_sin[i], s = cos_sin[half + i], x1 = v[i], x2 = v[half + i];
      v[i] = x1 * c - x2 * s;
      v[half + i] = x2 * c + x1 * s;
    }
  }
}

}  // namespace

class CpuDecoder {
 public:
  // bf16: the model's activations and pages are bfloat16 (else float32)
  CpuDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
             bool bf16)
      : hq_(num_heads),
        hk_(num_kv_heads),
        d_(head_dim),
        eps_(float(eps)),
        scale_(float(scale)),
        bf16_(bf16) {
    TORCH_CHECK(hq_ % hk_ == 0 && d_ % 8 == 0, "heads: Hq a multiple of Hk, D of 8");
  }

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, torch::Tensor pages,
                 std::vector<std::optional<torch::Tensor>> qkv,
                 std::vector<std::optional<torch::Tensor>> o,
                 std::vector<std::optional<torch::Tensor>> gate_up,
                 std::vector<std::optional<torch::Tensor>> down) {
    TORCH_CHECK(pages.dim() == 5 && pages.scalar_type() == (bf16_ ? at::kBFloat16 : at::kFloat),
                "pages: 5-D, in the model's dtype");
    TORCH_CHECK(pages.stride(2) == hk_ * d_ && pages.stride(3) == d_ && pages.stride(4) == 1,
                "pages: block-major rows of Hk * D");
    layers_.push_back(Layer{input_norm.to(at::kFloat).contiguous(),
                            post_norm.to(at::kFloat).contiguous(), pages,
                            projection(qkv), projection(o), projection(gate_up),
                            projection(down)});
  }

  // the token embedding [vocab, hidden] and the final norm's weight, in the model's dtype: the two
  // ends of a step, so that one call runs from token ids to the hidden states the LM head reads
  // (in Python, the lookup and the norm's five ops cost ~0.3 ms of a 12 ms bfloat16 step)
  void set_ends(torch::Tensor embedding, torch::Tensor final_norm) {
    TORCH_CHECK(embedding.dim() == 2 && final_norm.numel() == embedding.size(1),
                "embedding [vocab, hidden], final norm [hidden]");
    embedding_ = embedding;
    final_norm_ = final_norm.to(at::kFloat).contiguous();
  }

  // ids [B] the step's tokens at `positions` [B], each with a row of `block_tables` [B, blocks]
  // and a context of its position + 1 tokens -> [B, hidden] their final normed hidden states, in
  // the model's dtype (set_ends first). Each token's K and V go to its position's slot of its
  // table row: the rows graph_ops.kv_rows gives the graphs, found here without a tensor op.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions,
                        const torch::Tensor& block_tables, const torch::Tensor& cos_sin) {
    TORCH_CHECK(embedding_.defined(), "set_ends before forward");
    auto h = embedding_.index_select(0, ids.to(at::kLong)).to(at::kFloat).contiguous();
    const int64_t rows = h.size(0), width = h.size(1);
    auto residual = torch::zeros_like(h);
    auto x = torch::empty_like(h);
    const auto pos = positions.to(at::kLong).contiguous();
    const auto lens = pos + 1;
    const auto tables = block_tables.to(at::kLong).contiguous();
    const auto rope = cos_sin.to(at::kFloat).contiguous();
    TORCH_CHECK(pos.numel() == rows && tables.dim() == 2 && tables.size(0) == rows,
                "one position and a table row per token");
    auto attn = torch::empty({rows, hq_ * d_}, h.options());
    for (const Layer& layer : layers_) {
      add_and_norm(residual.data_ptr<float>(), h.data_ptr<float>(),
                   layer.input_norm.data_ptr<float>(), x.data_ptr<float>(), rows, width, eps_,
                   bf16_);
      auto qkv = layer.qkv(x);  // [B, (Hq + 2 Hk) D]
      if (bf16_) {
        store_and_attend<at::BFloat16>(layer, qkv, pos, tables, lens, rope, attn);
      } else {
        store_and_attend<float>(layer, qkv, pos, tables, lens, rope, attn);
      }
      h = layer.o(attn);
      add_and_norm(residual.data_ptr<float>(), h.data_ptr<float>(),
                   layer.post_norm.data_ptr<float>(), x.data_ptr<float>(), rows, width, eps_,
                   bf16_);
      auto gate_up = layer.gate_up(x);
      h = layer.down(silu_and_mul(gate_up));
    }
    add_and_norm(residual.data_ptr<float>(), h.data_ptr<float>(), final_norm_.data_ptr<float>(),
                 x.data_ptr<float>(), rows, width, eps_, bf16_);
    return bf16_ ? x.to(at::kBFloat16) : x;  // exact: rounded
  }

 private:
  static Projection projection(const std::vector<std::optional<torch::Tensor>>& parts) {
    TORCH_CHECK(parts.size() == 4 && parts[0], "a projection: (weight, scale, inv_smooth, bias)");
    return Projection{*parts[0], parts[1], parts[2], parts[3]};
  }

  // silu(gate) * up; in bfloat16 each of the two rounded, as the eager model's
  torch::Tensor silu_and_mul(const torch::Tensor& gate_up) const {
    const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
    auto out = torch::empty({rows, inner}, gate_up.options());
    const float* g = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t b = 0; b < rows; ++b) {
      const float* gb = g + b * 2 * inner;
      const float* ub = gb + inner;
      float* ob = o + b * inner;
      int64_t i = 0;
      for (; i + 8 <= inner; i += 8) {
        const __m256 gv = _mm256_loadu_ps(gb + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(ob + i, _mm256_mul_ps(gv, sig));
      }
      for (; i < inner; ++i) ob[i] = gb[i] / (1.0f + std::exp(-gb[i]));
      if (bf16_) round_bf16(ob, inner);
      for (int64_t j = 0; j < inner; ++j) ob[j] *= ub[j];
      if (bf16_) round_bf16(ob, inner);
    }
    return out;
  }

  // rotary on q and k, k and v into the pages, then each row's attention over its context
  template <typename P>
  void store_and_attend(const Layer& layer, torch::Tensor& qkv, const torch::Tensor& pos,
                        const torch::Tensor& tables, const torch::Tensor& lens,
                        const torch::Tensor& rope, torch::Tensor& out) const {
    const PageView<P> pages(layer.pages, hk_ * d_);
    const int64_t rows = qkv.size(0), stride = qkv.size(1), width = tables.size(1);
    float* q = qkv.data_ptr<float>();
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* table = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(0 <= p[b] && p[b] < rope.size(0), "a position past the rotary table");
      rotate(q + b * stride, hq_ + hk_, d_, rope.data_ptr<float>() + p[b] * d_);  // q, then k
      if (bf16_) round_bf16(q + b * stride, (hq_ + hk_) * d_);
      for (int kind = 0; kind < 2; ++kind) {  // K, then V
        pages.store(table + b * width, width, p[b], kind, q + b * stride + (hq_ + kind * hk_) * d_);
      }
    }
    const HeadShape shape{hq_, hk_, d_, scale_};
    attend_rows(pages, table, width, lens.data_ptr<int64_t>(), rows, shape,
                q, stride, out.data_ptr<float>());
    if (bf16_) round_bf16(out.data_ptr<float>(), out.numel());
  }

  int64_t hq_, hk_, d_;
  float eps_, scale_;
  bool bf16_;
  std::vector<Layer> layers_;
  torch::Tensor embedding_, final_norm_;
};

void bind_cpu_decoder(pybind11::module& m) {
  pybind11::class_<CpuDecoder>(m, "CpuDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool>())
      .def("add_layer", &CpuDecoder::add_layer)
      .def("set_ends", &CpuDecoder::set_ends)
      .def("forward", &CpuDecoder::forward);
}
