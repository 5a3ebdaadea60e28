// AVX2 helpers the extension's kernels share: exp and horizontal sums of 8 floats, and 8 float32
// or bfloat16 values loaded as floats.
#pragma once

#include <immintrin.h>

#include <torch/extension.h>

// Unrolls a loop over a register array in full. Left rolled, GCC keeps such an array on the stack
// and stores every element each iteration: colmajor_chunk<4> stored its 8 accumulators per weight
// row and ran at 2.7x the time of 3 rows in L1 (the bf16 2-row and INT8 4-row loops spilled too).
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")

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

// the sums of 4 vectors at once, lane t holding sum(a[t]): one shuffle tree for 4 dot products
// instead of a horizontal sum each
inline __m128 hsum4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
