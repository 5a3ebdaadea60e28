// A Llama decoder's layers for a decode step of 1-4 rows on a CPU, in one C++ call (issue 42).
//
// Why: at batch 1 a SmolLM2 step reads 538 MB of float32 weights (135 MB in INT8), which the
// few-row kernels stream at ~90% of a plain sum's speed. Run as 30 compiled Inductor graphs, one
// per layer, the step spent ~100 us a layer besides them: Dynamo's guards and frame, AOTAutograd's
// wrappers, Inductor's Python wrapper and five op calls (py-spy: 3-4 ms of a 24 ms step). Here
// the whole stack of layers is one loop: RMSNorm with the residual add, the fused QKV projection,
// rotary (rotate-half), the K/V write into the block-major pages, paged GQA attention over each
// row's own context, the output projection, the second norm, SiLU-and-mul and the down
// projection. The arithmetic is the eager model's: float32 math, the same kernels for the
// linears, softmax with the row max subtracted; a bfloat16 model's activations are rounded to
// bfloat16 wherever the eager model stores one (sums, norms, projections, rotary, SiLU).
//
// Rows are what decode_graph.py pads: a decode token, or one verification token with its own
// position, context length and table row. Pages are [blocks, 2, block_size, Hk, D] in the
// model's dtype with K and V rows of Hk * D values (graph_ops.fits); kv_rows [2, B] are
// graph_ops.kv_rows.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_gemv.h"

namespace {

// exp of 8 floats: 2^n * e^r with r in [-ln2/2, ln2/2] and a degree-6 polynomial (relative error
// ~2e-7, as expf's last bits); inputs below -87 give 0, as the masked scores need
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  const __m256 too_small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
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
    torch::Tensor y;
    if (weight.scalar_type() == at::kChar) {
      y = int8_gemv(inv_smooth ? (x * *inv_smooth).contiguous() : x, weight, *scale);
    } else {
      y = f32_colmajor_gemv(x, weight, 0);
    }
    return bias ? y.add_(*bias) : y;
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

// one layer's block-major pages [blocks, 2, block_size, Hk, D] as rows of Hk * D values
template <typename P>
struct PageView {
  P* base;
  int64_t row_width, block_size, blocks, block_stride, v_offset, limit;

  PageView(const torch::Tensor& pages, int64_t width)
      : base(pages.data_ptr<P>()),
        row_width(width),
        block_size(pages.size(2)),
        blocks(pages.size(0)),
        block_stride(pages.stride(0)),
        v_offset(pages.stride(1)),
        limit(kv_row_limit(pages, width)) {}

  // write one K or V row at `at` (graph_ops.kv_rows' numbering)
  void store(int64_t at, const float* src) const {
    TORCH_CHECK(0 <= at && at < limit, "a KV row outside the pages");
    for (int64_t i = 0; i < row_width; ++i) base[at * row_width + i] = P(src[i]);
  }

  // token t's K (kind 0) or V (kind 1) row of a table row; ids clamped into the cache, as
  // paged_decode.py's (a table slot past the context is never read: t < the context)
  const P* row(const int64_t* table, int64_t t, int kind) const {
    const int64_t block = std::clamp<int64_t>(table[t / block_size], 0, blocks - 1);
    return base + block * block_stride + kind * v_offset + (t % block_size) * row_width;
  }
};

// scores -> exp(score - max) in place; returns their sum, at least 1 (the max's own term is 1
// wherever a token is valid; an empty context returns 1 and its output stays 0)
float softmax(float* s, int64_t n) {
  float mx = -1e30f;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
    _mm256_storeu_ps(s + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return std::max(sum, 1.0f);
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

  // h [B, hidden] the embedded tokens -> (h, residual) after the last layer (the final norm is
  // the caller's)
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor h, const torch::Tensor& positions,
                                                  const torch::Tensor& kv_rows,
                                                  const torch::Tensor& block_tables,
                                                  const torch::Tensor& context_lens,
                                                  const torch::Tensor& cos_sin) {
    h = h.to(at::kFloat).contiguous();
    const int64_t rows = h.size(0), width = h.size(1);
    auto residual = torch::zeros_like(h);
    auto x = torch::empty_like(h);
    const auto pos = positions.to(at::kLong).contiguous();
    const auto kv = kv_rows.to(at::kLong).contiguous();
    const auto tables = block_tables.to(at::kLong).contiguous();
    const auto lens = context_lens.to(at::kLong).contiguous();
    const auto rope = cos_sin.to(at::kFloat).contiguous();
    TORCH_CHECK(pos.numel() == rows && kv.numel() == 2 * rows && lens.numel() == rows &&
                    tables.size(0) == rows,
                "one position, two KV rows, a table row and a context length per row");
    auto attn = torch::empty({rows, hq_ * d_}, h.options());
    for (const Layer& layer : layers_) {
      add_and_norm(residual.data_ptr<float>(), h.data_ptr<float>(),
                   layer.input_norm.data_ptr<float>(), x.data_ptr<float>(), rows, width, eps_,
                   bf16_);
      auto qkv = layer.qkv(x);  // [B, (Hq + 2 Hk) D]
      if (bf16_) {
        store_and_attend<at::BFloat16>(layer, qkv, pos, kv, tables, lens, rope, attn);
      } else {
        store_and_attend<float>(layer, qkv, pos, kv, tables, lens, rope, attn);
      }
      h = layer.o(attn);
      add_and_norm(residual.data_ptr<float>(), h.data_ptr<float>(),
                   layer.post_norm.data_ptr<float>(), x.data_ptr<float>(), rows, width, eps_,
                   bf16_);
      auto gate_up = layer.gate_up(x);
      h = layer.down(silu_and_mul(gate_up));
    }
    if (bf16_) return {h.to(at::kBFloat16), residual.to(at::kBFloat16)};  // exact: rounded
    return {h, residual};
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
                        const torch::Tensor& kv, const torch::Tensor& tables,
                        const torch::Tensor& lens, const torch::Tensor& rope,
                        torch::Tensor& out) const {
    const PageView<P> pages(layer.pages, hk_ * d_);
    const int64_t rows = qkv.size(0), stride = qkv.size(1), width = tables.size(1);
    float* q = qkv.data_ptr<float>();
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* r = kv.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(0 <= p[b] && p[b] < rope.size(0), "a position past the rotary table");
      rotate(q + b * stride, hq_ + hk_, d_, rope.data_ptr<float>() + p[b] * d_);  // q, then k
      if (bf16_) round_bf16(q + b * stride, (hq_ + hk_) * d_);
      for (int kind = 0; kind < 2; ++kind) {  // K, then V
        pages.store(r[kind * rows + b], q + b * stride + (hq_ + kind * hk_) * d_);
      }
    }
    const int64_t* table = tables.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t ctx = std::min(len[b], width * pages.block_size);
      for (int64_t g = 0; g < hk_; ++g) {
        float* o = out.data_ptr<float>() + (b * hq_ + g * (hq_ / hk_)) * d_;
        attend(pages, table + b * width, ctx, g, q + b * stride + g * (hq_ / hk_) * d_, o);
      }
    }
  }

  // the query heads of KV head g (at q, adjacent) over ctx cached tokens of one table row
  template <typename P>
  void attend(const PageView<P>& pages, const int64_t* table, int64_t ctx, int64_t g,
              const float* q, float* out) const {
    const int64_t group = hq_ / hk_;
    std::vector<float> scores(group * std::max<int64_t>(ctx, 1));  // [j * ctx + t]
    for (int64_t t = 0; t < ctx; ++t) {
      const P* k = pages.row(table, t, 0) + g * d_;
      for (int64_t j = 0; j < group; ++j) {
        __m256 dot = _mm256_setzero_ps();
        for (int64_t i = 0; i < d_; i += 8) {
          dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d_ + i), load8(k + i), dot);
        }
        scores[j * ctx + t] = hsum(dot) * scale_;
      }
    }
    std::vector<float> denom(group);
    for (int64_t j = 0; j < group; ++j) denom[j] = softmax(scores.data() + j * ctx, ctx);
    std::fill(out, out + group * d_, 0.0f);
    for (int64_t t = 0; t < ctx; ++t) {
      const P* v = pages.row(table, t, 1) + g * d_;
      for (int64_t j = 0; j < group; ++j) {
        const __m256 w = _mm256_set1_ps(scores[j * ctx + t]);
        float* a = out + j * d_;
        for (int64_t i = 0; i < d_; i += 8) {
          _mm256_storeu_ps(a + i, _mm256_fmadd_ps(w, load8(v + i), _mm256_loadu_ps(a + i)));
        }
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      for (int64_t i = 0; i < d_; ++i) out[j * d_ + i] /= denom[j];
    }
    if (bf16_) round_bf16(out, group * d_);
  }

  int64_t hq_, hk_, d_;
  float eps_, scale_;
  bool bf16_;
  std::vector<Layer> layers_;
};

void bind_cpu_decoder(pybind11::module& m) {
  pybind11::class_<CpuDecoder>(m, "CpuDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool>())
      .def("add_layer", &CpuDecoder::add_layer)
      .def("forward", &CpuDecoder::forward);
}
