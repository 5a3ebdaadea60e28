// Float32 linear layers over a column-major weight on an AVX2 CPU (issue 42): y = x @ W.T for
// 1 to kMaxGemmRows rows of x, where MKL repacks such a weight on every call.
//
// The weight is stored transposed ([K, N] contiguous, model_setup.lay_out_for_gemv's layout), so
// 16 output columns are one 64-byte line of each weight row, and the sums of a row of x stay in
// registers while the weight streams past. Every form below adds a y element's products in
// weight-row order with fused multiply-adds from 0, so a row's result is the same whatever rows
// are beside it and whichever form ran (a test holds this).

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_gemv.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>

namespace {

// y = R rows of x against a float32 weight stored column-major, wt its transpose [K, N]
// contiguous (model_setup.lay_out_for_gemv's layout, where MKL's one-row GEMV reads at the bus's
// speed but its GEMM of 2-4 rows at 40-60% of it). The weight streams in blocks of `block` rows:
// within a block, 16 columns at a time read one 64-byte line from each row, and the R x 16
// partial sums stay in registers across a block and in y across blocks.
// - One row over a narrow weight (R x N sums within kSequentialBytes, in L1): blocks of one
//   row, so the weight streams front to back as one sequence, as a plain sum reads it. On issue
//   42's second CPU (Zen 4, weights in 2 MiB pages, one thread) SmolLM2's decoder linears took
//   17.1 ms so against 24.7 ms in blocks of 8 (a plain sum: 15.3).
// - Otherwise blocks of kBlockK rows: the next 16 columns continue kBlockK streams the
//   prefetcher follows, and y is read and written once per block, not once per weight row (a
//   113 MB LM head's 49152 sums are 192 KiB). On the first CPU (AVX2, one thread) 4 rows took
//   31 ms in blocks of 4, 24-26 ms in blocks of 8, 48 ms in blocks of 32.
// A row's sums run in the same order whatever R is, so 3 rows padded to 4 give the same 3 results.
constexpr int64_t kBlockK = 8;

constexpr int64_t kSequentialBytes = 16 * 1024;

int64_t block_rows(int64_t rows, int64_t n) {
  return rows == 1 && n * int64_t(sizeof(float)) <= kSequentialBytes ? 1 : kBlockK;
}

// weight rows [kb, ke) of a column-major weight: what one thread streams
struct RowRange {
  int64_t begin, end;
};

// y[r, j:j+16] += the products of weight rows [k0, k1) for r < R, the R x 16 sums in registers
template <int R>
inline void colmajor_chunk(const float* x, const float* wt, float* y, int64_t k, int64_t n,
                           int64_t k0, int64_t k1, int64_t j) {
  __m256 lo[R], hi[R];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_loadu_ps(y + r * n + j);
    hi[r] = _mm256_loadu_ps(y + r * n + j + 8);
  }
  for (int64_t i = k0; i < k1; ++i) {
    const float* row = wt + i * n + j;
    const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k + i);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * n + j, lo[r]);
    _mm256_storeu_ps(y + r * n + j + 8, hi[r]);
  }
}

// the same for columns [j0, n1) short of 16, one at a time, for `rows` rows of x
inline void colmajor_tail(const float* x, const float* wt, float* y, int64_t rows, int64_t k,
                          int64_t n, int64_t k0, int64_t k1, int64_t j0, int64_t n1) {
  for (int64_t j = j0; j < n1; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = y[r * n + j];
      // fused, as the vector columns: the same sums whatever the block and row count
      for (int64_t i = k0; i < k1; ++i) sum = std::fma(x[r * k + i], wt[i * n + j], sum);
      y[r * n + j] = sum;
    }
  }
}

void zero_columns(float* y, int64_t rows, int64_t n, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < rows; ++r) std::fill(y + r * n + n0, y + r * n + n1, 0.0f);
}

// Blocks of weight rows are kBlockK streams at once, which the hardware prefetcher follows less
// well than one: each 16-column piece also asks for the next block's lines kPrefetchAhead
// columns on. SmolLM2's decoder linears from huge pages, one thread: 4 rows 23.6 ms against
// 28.7, 8 rows 33 against 41 (1 row, one stream: 15.8).
constexpr int64_t kPrefetchAhead = 64;

// the lines of weight rows [k0, k1) at column j (nothing past the row's end)
inline void prefetch_rows(const float* wt, int64_t n, int64_t k0, int64_t k1, int64_t j) {
  if (j >= n) return;
  for (int64_t i = k0; i < k1; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(wt + i * n + j), _MM_HINT_T0);
  }
}

// y = R rows of x against the weight rows in `range`, in blocks of `block` weight rows
template <int R>
void colmajor_rows(const float* x, const float* wt, float* y, int64_t k, int64_t n,
                   int64_t block, RowRange range) {
  const int64_t n16 = n / 16 * 16;
  zero_columns(y, R, n, 0, n);
  for (int64_t k0 = range.begin; k0 < range.end; k0 += block) {
    const int64_t k1 = std::min(range.end, k0 + block);
    const int64_t p1 = std::min(range.end, k1 + block);
    for (int64_t j = 0; j < n16; j += 16) {
      if (block > 1) prefetch_rows(wt, n, k1, p1, j + kPrefetchAhead);
      colmajor_chunk<R>(x, wt, y, k, n, k0, k1, j);
    }
    colmajor_tail(x, wt, y, R, k, n, k0, k1, n16, n);
  }
}

void colmajor_group(const float* x, const float* wt, float* y, int64_t rows, int64_t k, int64_t n,
                    int64_t block, RowRange range) {
  switch (rows) {
    case 1: return colmajor_rows<1>(x, wt, y, k, n, block, range);
    case 2: return colmajor_rows<2>(x, wt, y, k, n, block, range);
    case 3: return colmajor_rows<3>(x, wt, y, k, n, block, range);
    default: return colmajor_rows<4>(x, wt, y, k, n, block, range);
  }
}

// kMaxRows < b <= kMaxGemmRows rows: the weight streams as for 4 rows (blocks of kBlockK rows,
// 16 columns at a time), and each 16-column piece of a block, read from memory by the first
// group of 4 rows of x, serves the other groups from L1 before the next piece. Measured on issue
// 42's Zen 4 VM (SmolLM2's five linear shapes, one thread): 5 rows 1.4x the time of one, 8 rows
// 2x, against 5.9x and 6.3x for tiles of 128 columns by 256 weight rows that every group of 4
// read in turn (a walk down 256 rows at a time, which the prefetcher does not follow).
void colmajor_interleaved(const float* x, const float* wt, float* y, int64_t b, int64_t k,
                          int64_t n, RowRange range) {
  const int64_t n16 = n / 16 * 16, whole = b / kMaxRows * kMaxRows, rest = b - whole;
  zero_columns(y, b, n, 0, n);
  for (int64_t k0 = range.begin; k0 < range.end; k0 += kBlockK) {
    const int64_t k1 = std::min(range.end, k0 + kBlockK);
    const int64_t p1 = std::min(range.end, k1 + kBlockK);
    for (int64_t j = 0; j < n16; j += 16) {
      prefetch_rows(wt, n, k1, p1, j + kPrefetchAhead);
      for (int64_t r = 0; r < whole; r += kMaxRows) {
        colmajor_chunk<kMaxRows>(x + r * k, wt, y + r * n, k, n, k0, k1, j);
      }
      const float* xr = x + whole * k;
      float* yr = y + whole * n;
      switch (rest) {
        case 1: colmajor_chunk<1>(xr, wt, yr, k, n, k0, k1, j); break;
        case 2: colmajor_chunk<2>(xr, wt, yr, k, n, k0, k1, j); break;
        case 3: colmajor_chunk<3>(xr, wt, yr, k, n, k0, k1, j); break;
        default: break;
      }
    }
    colmajor_tail(x, wt, y, b, k, n, k0, k1, n16, n);
  }
}

}  // namespace

// y = x @ weight.T, float32 weight [N, K] stored column-major (weight.t() contiguous); block:
// weight rows per block, 0 = block_rows' choice (another value is for perf/gemv_bench)
torch::Tensor f32_colmajor_gemv(torch::Tensor x, torch::Tensor weight, int64_t block) {
  check_linear(x, weight, /*column_major=*/true);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight: float32");
  const int64_t b = x.size(0), k = x.size(1), n = weight.size(0);
  auto y = torch::empty({b, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t rows_per_block = block > 0 ? block : block_rows(b, n);
  // Threads split the weight's rows, not its columns: each streams one contiguous run of the
  // weight into sums of its own (split by columns, every thread reads short pieces of every
  // row), and the runs' sums add in run order, so a row's result is the same whatever rows are
  // beside it. SmolLM2's LM head at one row: 9.3 ms on one thread, 4.6 on two.
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), k / 64));
  auto partial = runs == 1 ? y : torch::empty({runs, b, n}, x.options());
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, runs, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const RowRange range{k * c / runs, k * (c + 1) / runs};
      float* out = pp + c * b * n;
      if (b > kMaxRows) {
        colmajor_interleaved(xp, wp, out, b, k, n, range);
      } else {
        colmajor_group(xp, wp, out, b, k, n, rows_per_block, range);
      }
    }
  });
  if (runs > 1) {
    y.copy_(partial[0]);
    for (int64_t c = 1; c < runs; ++c) y.add_(partial[c]);
  }
  return y;
}
