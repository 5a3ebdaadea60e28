// Paged GQA decode attention over the engine's block-major pages, in place (issue 42): the
// attention of the fused decoder (cpu_decode.cpp) and of the compiled decode step's opaque op
// (cpu_attention.cpp).
//
// One query row attends over its own context a block at a time, where the page holds it: the
// scores of the query heads that share a KV head against the block's K rows, an online softmax,
// then the weighted sum of its V rows. Nothing is gathered. A task of at::parallel_for is a row
// (all its KV heads: each block is then read as one run), or a (row, KV head) where there are
// fewer rows than threads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_gemv.h"
#include "cpu_simd.h"

// one layer's block-major pages [blocks, 2, block_size, Hk, D] as rows of Hk * D values
template <typename P>
struct PageView {
  P* base;
  int64_t row_width, block_size, blocks, block_stride, v_offset;

  PageView(const torch::Tensor& pages, int64_t width)
      : base(pages.data_ptr<P>()),
        row_width(width),
        block_size(pages.size(2)),
        blocks(pages.size(0)),
        block_stride(pages.stride(0)),
        v_offset(pages.stride(1)) {}

  // write token t's K (kind 0) or V (kind 1) row into its block of a table row of `width` blocks
  void store(const int64_t* table, int64_t width, int64_t t, int kind, const float* src) const {
    TORCH_CHECK(0 <= t && t < width * block_size, "a token past its table row");
    const int64_t block = table[t / block_size];
    TORCH_CHECK(0 <= block && block < blocks, "a token's block outside the pages");
    P* dst = base + block * block_stride + kind * v_offset + (t % block_size) * row_width;
    for (int64_t i = 0; i < row_width; ++i) dst[i] = P(src[i]);
  }

  // token t's K (kind 0) or V (kind 1) row of a table row; ids clamped into the cache, as
  // paged_decode.py's (a table slot past the context is never read: t < the context)
  const P* row(const int64_t* table, int64_t t, int kind) const {
    const int64_t block = std::clamp<int64_t>(table[t / block_size], 0, blocks - 1);
    return base + block * block_stride + kind * v_offset + (t % block_size) * row_width;
  }
};

// The shape of the heads: Hq query heads over Hk KV heads of D values (D a multiple of 8).
struct HeadShape {
  int64_t hq, hk, d;
  float scale;
};

// Ask for the lines of `bytes` at p ahead of their use: the next block of a context is anywhere
// in the cache, where the hardware prefetcher starts cold. A few lines at a time, as the current
// block's rows are read: a burst of a block's lines at once fills the core's miss buffers and
// the rest are dropped. Into L2, not L1: asked into L1, each line held one of L1's few miss
// buffers until it came, and the kernel read 7-8 GB/s from memory on one core; into L2, 17-19
// (Zen 4, SmolLM2's heads at batch 16-64, pages in huge pages; two blocks ahead or a burst a
// block: slower).
constexpr int64_t kPrefetchBlocks = 1;

inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(static_cast<const char*>(p) + at, _MM_HINT_T1);
  }
}

// the largest of p[0..n)
inline float max_of(const float* p, int64_t n) {
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + t));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float mx = _mm_cvtss_f32(m4);
  for (; t < n; ++t) mx = std::max(mx, p[t]);
  return mx;
}

// p[0..n) = exp(p - mx) in place; returns their sum
inline float exp_shifted(float* p, int64_t n, float mx) {
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), m8));
    _mm256_storeu_ps(p + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; t < n; ++t) {
    p[t] = std::exp(p[t] - mx);
    sum += p[t];
  }
  return sum;
}

// One block of one KV head for its G query heads (q: their G rows of D): scores [G][bs] of n
// rows of K at k (rw apart), four tokens at a time with every accumulator in a register (G x 4,
// summed by one shuffle tree a head); each K vector is loaded once for the G heads. next: the
// same rows of the next block, to prefetch (or null).
template <int G, typename P>
inline void block_scores(const P* k, int64_t rw, int64_t n, int64_t d, const float* q,
                         float scale, float* scores, int64_t bs, const P* next) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    if (next) {
      PDSERVE_UNROLL
      for (int u = 0; u < 4; ++u) prefetch_lines(next + (t + u) * rw, d * int64_t(sizeof(P)));
    }
    __m256 acc[G][4];
    PDSERVE_UNROLL
    for (int j = 0; j < G; ++j) {
      PDSERVE_UNROLL
      for (int u = 0; u < 4; ++u) acc[j][u] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < d; i += 8) {
      __m256 qv[G];
      PDSERVE_UNROLL
      for (int j = 0; j < G; ++j) qv[j] = _mm256_loadu_ps(q + j * d + i);
      PDSERVE_UNROLL
      for (int u = 0; u < 4; ++u) {
        const __m256 kv = load8(k + (t + u) * rw + i);
        PDSERVE_UNROLL
        for (int j = 0; j < G; ++j) acc[j][u] = _mm256_fmadd_ps(qv[j], kv, acc[j][u]);
      }
    }
    PDSERVE_UNROLL
    for (int j = 0; j < G; ++j) {
      _mm_storeu_ps(scores + j * bs + t, _mm_mul_ps(hsum4(acc[j]), _mm_set1_ps(scale)));
    }
  }
  for (; t < n; ++t) {
    PDSERVE_UNROLL
    for (int j = 0; j < G; ++j) {
      __m256 dot = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), load8(k + t * rw + i), dot);
      }
      scores[j * bs + t] = hsum(dot) * scale;
    }
  }
}

// out [G][D] += weights [G][bs] x n rows of V at v (rw apart), C vectors of D at a time: the
// G x C accumulators stay in registers across the block's rows, each V vector loaded once.
// next: as block_scores'.
template <int G, int C, typename P>
inline void block_values(const P* v, int64_t rw, int64_t n, int64_t d, const float* weights,
                         int64_t bs, float* out, const P* next) {
  for (int64_t i0 = 0; i0 < d; i0 += 8 * C) {
    __m256 acc[G][C];
    PDSERVE_UNROLL
    for (int j = 0; j < G; ++j) {
      PDSERVE_UNROLL
      for (int c = 0; c < C; ++c) acc[j][c] = _mm256_loadu_ps(out + j * d + i0 + 8 * c);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (next) prefetch_lines(next + t * rw + i0, 8 * C * int64_t(sizeof(P)));
      __m256 w[G];
      PDSERVE_UNROLL
      for (int j = 0; j < G; ++j) w[j] = _mm256_broadcast_ss(weights + j * bs + t);
      PDSERVE_UNROLL
      for (int c = 0; c < C; ++c) {
        const __m256 vv = load8(v + t * rw + i0 + 8 * c);
        PDSERVE_UNROLL
        for (int j = 0; j < G; ++j) acc[j][c] = _mm256_fmadd_ps(w[j], vv, acc[j][c]);
      }
    }
    PDSERVE_UNROLL
    for (int j = 0; j < G; ++j) {
      PDSERVE_UNROLL
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + j * d + i0 + 8 * c, acc[j][c]);
    }
  }
}

// A block of every KV head in [g0, g1): scores, then (after the caller's softmax) values, with
// the register tiling that fits the group size (G x C accumulators within AVX2's 16 registers);
// other group sizes go a query head at a time.
template <typename P>
struct BlockKernels {
  using Scores = void (*)(const P*, int64_t, int64_t, int64_t, const float*, float, float*,
                          int64_t, const P*);
  using Values = void (*)(const P*, int64_t, int64_t, int64_t, const float*, int64_t, float*,
                          const P*);
  Scores scores;
  Values values;
  int64_t heads_a_call;  // query heads one call covers: the group, or 1

  BlockKernels(int64_t group, int64_t d) {
    const bool by32 = d % 32 == 0, by16 = d % 16 == 0;
    heads_a_call = group;
    if (group == 3 && by32) {
      scores = block_scores<3, P>, values = block_values<3, 4, P>;
    } else if (group == 2 && by32) {
      scores = block_scores<2, P>, values = block_values<2, 4, P>;
    } else if (group == 4 && by16) {
      scores = block_scores<4, P>, values = block_values<4, 2, P>;
    } else {
      heads_a_call = 1;
      scores = block_scores<1, P>;
      values = by32 ? block_values<1, 4, P> : block_values<1, 1, P>;
    }
  }
};

// The query heads of KV heads [g0, g1) (q and out: their rows of D, adjacent) over ctx cached
// tokens of one table row, a block at a time: the block's K rows, then its V rows, which the page
// holds right after them (one run of memory, where two passes over the context would read K's
// and V's halves apart), with the softmax kept online (a running max and sum per query head, the
// partial output rescaled when the max grows, as flash attention's). scores: room for
// (g1 - g0) * group * block_size floats. then_k and then_v: the first block's K and V rows of the
// task that comes next (null: none), prefetched with the last block (offset as this task's
// heads are: (g0 of that task - g0) * D apart from its block's row).
template <typename P>
void attend_heads(const PageView<P>& pages, const int64_t* table, int64_t ctx, int64_t g0,
                  int64_t g1, const HeadShape& s, const float* q, float* out, float* scores,
                  const P* then_k, const P* then_v) {
  const int64_t group = s.hq / s.hk, d = s.d, heads = (g1 - g0) * group;
  const int64_t bs = pages.block_size, rw = pages.row_width;
  const BlockKernels<P> kernels(group, d);
  const int64_t step = kernels.heads_a_call;
  float run_max[128], run_sum[128];
  TORCH_CHECK(heads <= 128, "at most 128 query heads a task");
  std::fill(run_max, run_max + heads, -1e30f);
  std::fill(run_sum, run_sum + heads, 0.0f);
  std::fill(out, out + heads * d, 0.0f);
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const int64_t n = std::min(bs, ctx - t0);
    const P* kb = pages.row(table, t0, 0);
    const P* vb = pages.row(table, t0, 1);
    // the same rows of the next block, asked for while this one is computed on
    const int64_t ahead = t0 + kPrefetchBlocks * bs;
    const P* next_k = ahead < ctx ? pages.row(table, ahead, 0) : then_k;
    const P* next_v = ahead < ctx ? pages.row(table, ahead, 1) : then_v;
    for (int64_t h = 0; h < heads; h += step) {  // scores [h * bs + t]
      const P* k = kb + (g0 + h / group) * d;
      const P* next = next_k ? next_k + (g0 + h / group) * d : nullptr;
      kernels.scores(k, rw, n, d, q + h * d, s.scale, scores + h * bs, bs, next);
    }
    // the online softmax: weights against the running max, the partial output rescaled
    for (int64_t h = 0; h < heads; ++h) {
      float* p = scores + h * bs;
      const float block_max = max_of(p, n);
      if (block_max > run_max[h]) {
        const float shrink = std::exp(run_max[h] - block_max);
        run_sum[h] *= shrink;
        for (int64_t i = 0; i < d; ++i) out[h * d + i] *= shrink;
        run_max[h] = block_max;
      }
      run_sum[h] += exp_shifted(p, n, run_max[h]);
    }
    for (int64_t h = 0; h < heads; h += step) {
      const P* v = vb + (g0 + h / group) * d;
      const P* next = next_v ? next_v + (g0 + h / group) * d : nullptr;
      kernels.values(v, rw, n, d, scores + h * bs, bs, out + h * d, next);
    }
  }
  // >= 1 wherever the context is not empty (the max's own term); an empty one stays 0
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = run_sum[h] > 0 ? 1.0f / run_sum[h] : 0.0f;
    for (int64_t i = 0; i < d; ++i) out[h * d + i] *= inv;
  }
}

// Every row's attention: q and out [rows, Hq * D] float32 with row strides q_stride and
// Hq * D; tables [rows, width]; lens [rows] (clamped to the table's span). A task is a row (its
// K and V rows are then read whole: each block's run is one stream), or a (row, KV head) where
// there are fewer rows than threads. A task's last block prefetches the next task's first: left
// cold, that block cost a 512-token context ~10% of its time (Zen 4, one thread, batch 16-64).
template <typename P>
void attend_rows(const PageView<P>& pages, const int64_t* tables, int64_t width,
                 const int64_t* lens, int64_t rows, const HeadShape& s, const float* q,
                 int64_t q_stride, float* out) {
  const int64_t group = s.hq / s.hk, span = width * pages.block_size;
  const int64_t split = rows < at::get_num_threads() ? s.hk : 1;  // tasks a row
  const int64_t heads = s.hk / split;  // KV heads a task
  at::parallel_for(0, rows * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / split, g0 = (task % split) * heads;
      const int64_t ctx = std::clamp<int64_t>(lens[b], 0, span);
      scores.resize(heads * group * pages.block_size);
      const P* then_k = nullptr;
      const P* then_v = nullptr;
      if (task + 1 < end) {
        const int64_t b_next = (task + 1) / split, g0_next = ((task + 1) % split) * heads;
        if (std::min(lens[b_next], span) > 0) {
          const int64_t shift = (g0_next - g0) * s.d;
          then_k = pages.row(tables + b_next * width, 0, 0) + shift;
          then_v = pages.row(tables + b_next * width, 0, 1) + shift;
        }
      }
      attend_heads(pages, tables + b * width, ctx, g0, g0 + heads, s,
                   q + b * q_stride + g0 * group * s.d, out + (b * s.hq + g0 * group) * s.d,
                   scores.data(), then_k, then_v);
    }
  });
}
