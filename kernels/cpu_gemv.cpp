// Few-row linear layers on an AVX2 CPU (issue 42): y = x @ W.T over 1-, 2- and 4-byte weights.
//
// Why a kernel of our own: measured on this CPU at one row, one thread (perf/gemv_bench.py),
// fbgemm's dynamic INT8 linear read its weights at about half of a plain sum of the same bytes,
// ATen's _weight_int8pack_mm and an Inductor-compiled dequantizing reduction (x * w.float())
// .sum(-1) at 3-15% of it (Inductor's int8 loads of 8 lanes go through a buffer), and oneDNN's
// bf16 matmul at about 40%. A decode step at batch 1-4 reads each weight byte once and does 1-4
// multiply-adds with it, so the loops below are built to keep up with the bus: INT8 in exact
// integers, 32 weights a maddubs; bfloat16 widened to float32 in registers (a shift).
//
// Weights are row-major [N, K] (K contiguous); x is float32 [B, K]; the rows of x are taken in
// groups (INT8: up to 4, bfloat16: up to 8), so the weight is read once per group. Float32
// weights stored column-major have kernels of their own (cpu_colmajor.cpp).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_gemv.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// 16 bfloat16 weights from w as two vectors of 8 floats: a bf16 is a float's high half
inline void widen16(const at::BFloat16* w, __m256& lo, __m256& hi) {
  const __m128i* p = reinterpret_cast<const __m128i*>(w);
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
}

inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// R <= 2 rows of x against one weight row of k: four accumulators a row of x (32 weights an
// iteration). With two, each iteration waited on the last one's FMAs, and one row read
// bfloat16 weights at 85% of a plain sum's speed; with four at 90-95% (SmolLM2's weights from
// huge pages, one thread: 10.6-9.7 ms a pass against 11.8-11.0). More rows take the same
// (L1-resident) weight row again two at a time: four rows' sixteen accumulators would spill.
template <typename W, int R>
void dot_rows(const float* x, const W* row, int64_t k, float* sums) {
  const int64_t k32 = k - k % 32, k16 = k - k % 16;
  __m256 acc[R][4];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    PDSERVE_UNROLL
    for (int a = 0; a < 4; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < k32; i += 32) {
    __m256 lo0, hi0, lo1, hi1;
    widen16(row + i, lo0, hi0);
    widen16(row + i + 16, lo1, hi1);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + i;
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), lo0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), hi0, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), lo1, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), hi1, acc[r][3]);
    }
  }
  if (k32 < k16) {
    __m256 lo, hi;
    widen16(row + k32, lo, hi);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + k32), lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + k32 + 8), hi, acc[r][1]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    const __m256 sum4 = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][2]),
                                      _mm256_add_ps(acc[r][1], acc[r][3]));
    float sum = hsum(sum4);
    for (int64_t i = k16; i < k; ++i) sum += x[r * k + i] * to_float(row[i]);
    sums[r] = sum;
  }
}

// y[b, n] for b < R, n in [n0, n1): R rows of x against rows n of w; a row's sums run in the
// same order whatever R is
template <typename W, int R>
void gemv_rows(const float* x, const W* w, const float* scale, float* y, int64_t k, int64_t ldy,
               int64_t n0, int64_t n1) {
  float sums[R];
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * k;
    for (int r = 0; r + 1 < R; r += 2) dot_rows<W, 2>(x + r * k, row, k, sums + r);
    if (R % 2) dot_rows<W, 1>(x + (R - 1) * k, row, k, sums + R - 1);
    const float s = scale == nullptr ? 1.0f : scale[n];
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) y[r * ldy + n] = sums[r] * s;
  }
}

template <typename W>
void gemv_group(const float* x, const W* w, const float* scale, float* y, int64_t rows, int64_t k,
                int64_t ldy, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return gemv_rows<W, 1>(x, w, scale, y, k, ldy, n0, n1);
    case 2: return gemv_rows<W, 2>(x, w, scale, y, k, ldy, n0, n1);
    case 3: return gemv_rows<W, 3>(x, w, scale, y, k, ldy, n0, n1);
    case 4: return gemv_rows<W, 4>(x, w, scale, y, k, ldy, n0, n1);
    case 5: return gemv_rows<W, 5>(x, w, scale, y, k, ldy, n0, n1);
    case 6: return gemv_rows<W, 6>(x, w, scale, y, k, ldy, n0, n1);
    case 7: return gemv_rows<W, 7>(x, w, scale, y, k, ldy, n0, n1);
    default: return gemv_rows<W, 8>(x, w, scale, y, k, ldy, n0, n1);
  }
}

template <typename W>
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const float* scale) {
  const int64_t b = x.size(0), k = x.size(1), n = w.size(0);
  auto y = torch::empty({b, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const W* wp = w.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  // 64 output channels a task: a 36 KiB slice of a 576-wide int8 weight
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < b; r += kBf16Rows) {
      gemv_group<W>(xp + r * k, wp, scale, yp + r * n, std::min(kBf16Rows, b - r), k, n, n0, n1);
    }
  });
  return y;
}

// x [b, k] float -> xq int8 and one scale per row: x ~= xq * xs
void quantize_rows(const float* x, int8_t* xq, float* xs, int64_t b, int64_t k) {
  for (int64_t r = 0; r < b; ++r) {
    const float* row = x + r * k;
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
    // as quantize_per_token (services/engine/quant/int8_weights.py) rounds: x / s, half to even
    const float s = std::max(amax, 1e-12f) / 127.0f;
    for (int64_t i = 0; i < k; ++i) xq[r * k + i] = static_cast<int8_t>(std::nearbyint(row[i] / s));
    xs[r] = s;
  }
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// R rows of int8 x against rows [n0, n1) of int8 w: maddubs takes an unsigned and a signed
// operand, so |w| goes unsigned and each x takes w's sign (w * x = |w| * (sign(w) x))
template <int R>
void int8_rows(const int8_t* x, const float* xs, const int8_t* w, const float* scale, float* y,
               int64_t k, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t k32 = k - k % 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * k;
    __m256i acc[R];
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k32; i += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + i));
        const __m256i p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p16, ones));
      }
    }
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t sum = hsum_epi32(acc[r]);
      for (int64_t i = k32; i < k; ++i) sum += int32_t(x[r * k + i]) * int32_t(row[i]);
      y[r * ldy + n] = float(sum) * xs[r] * scale[n];
    }
  }
}

void int8_group(const int8_t* x, const float* xs, const int8_t* w, const float* scale, float* y,
                int64_t rows, int64_t k, int64_t ldy, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return int8_rows<1>(x, xs, w, scale, y, k, ldy, n0, n1);
    case 2: return int8_rows<2>(x, xs, w, scale, y, k, ldy, n0, n1);
    case 3: return int8_rows<3>(x, xs, w, scale, y, k, ldy, n0, n1);
    default: return int8_rows<4>(x, xs, w, scale, y, k, ldy, n0, n1);
  }
}


}  // namespace

// x a contiguous float32 [B, K] and w a [N, K] weight on the CPU, row- or column-major
void check_linear(const torch::Tensor& x, const torch::Tensor& w, bool column_major) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [B, K]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "w: [N, K]");
  TORCH_CHECK(column_major ? w.t().is_contiguous() : w.is_contiguous(),
              column_major ? "w: column-major" : "w: contiguous");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors");
}

// y = (x @ qweight.T) * scale: int8 qweight [N, K], one float32 scale per output channel.
// Each row of x is first rounded to int8 with one scale of its own (symmetric, 127 levels, as
// llama.cpp's Q8_0 rounds its activations per block), so the products are exact integers:
// _mm256_maddubs_epi16 multiplies 32 weight bytes by 32 activation bytes a uop, and a row's
// sums stay in int32 (|q| <= 127: 127 * 127 * K fits for K < 133,000).
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale) {
  check_linear(x, qweight, /*column_major=*/false);
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "qweight: int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == qweight.size(0),
              "scale: float32 [N]");
  const int64_t b = x.size(0), k = x.size(1), n = qweight.size(0);
  auto xq = torch::empty({b, k}, x.options().dtype(at::kChar));
  std::vector<float> xs(b);
  quantize_rows(x.data_ptr<float>(), xq.data_ptr<int8_t>(), xs.data(), b, k);
  auto y = torch::empty({b, n}, x.options());
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < b; r += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, b - r);
      int8_group(xp + r * k, xs.data() + r, wp, sp, yp + r * n, rows, k, n, n0, n1);
    }
  });
  return y;
}

// y = x @ weight.T, bfloat16 weight [N, K], float32 x and y
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor weight) {
  check_linear(x, weight, /*column_major=*/false);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight: bfloat16");
  return gemv<at::BFloat16>(x, weight, nullptr);
}
