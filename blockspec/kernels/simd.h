// Helpers the fused CPU ops share (fused_ops.cpp, attention.cpp): 8-lane sums and max, a vector exp, the
// CPU check, and when to wake torch's thread pool.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BLOCKSPEC_X86 1
#endif

namespace blockspec_kernels {

inline constexpr float kMinExpArg = -87.3f;  // exp below this is < 1.2e-38: taken as 0 (and -inf gives 0)

#ifdef BLOCKSPEC_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

AVX2 inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// exp of 8 lanes (Cephes' polynomial after a base-2 range reduction; ~1 ulp), 0 below kMinExpArg.
AVX2 inline __m256 exp8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kMinExpArg), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kMinExpArg)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
  const __m256i pow2 = _mm256_slli_epi32(exponent, 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2)), keep);
}

inline bool avx2_fma() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
}
#else
inline bool avx2_fma() { return false; }
#endif

inline float exp1(float x) { return x < kMinExpArg ? 0.0f : std::exp(x); }

inline void check_cpu_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "blockspec ", op, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() > 0 && t.stride(-1) == 1, "blockspec ", op, ": ", name,
              "'s last dim must be contiguous");
}

// Runs fn(i0, i1) over [0, n) on torch's pool when the work (flops) pays for waking it, else inline.
template <typename F>
void maybe_parallel(int64_t n, int64_t flops_per_item, const F& fn) {
  constexpr int64_t kParallelFlops = 1 << 20;
  if (n * flops_per_item < kParallelFlops || at::get_num_threads() == 1) return fn(0, n);
  const int64_t grain = std::max<int64_t>(1, (kParallelFlops / 4) / std::max<int64_t>(flops_per_item, 1));
  at::parallel_for(0, n, grain, fn);
}

}  // namespace blockspec_kernels
