// The arithmetic of one (query, head) pair in attention.cpp: its scores over a tile of keys (8 lanes over the
// head dimension, reduced in one fixed tree), its visible keys gathered in key order, the softmax over them
// and the V rows accumulated in key order. Portable and AVX2 forms give the same bits.

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_tiles.h"

namespace blockspec_kernels {

// ---- scores ---------------------------------------------------------------------------------------------

// The lanes of a score reduced as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float reduce_lanes(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// Scores of queries qa, qb over keys k[0..4) (rows `stride` apart) into sa[0..4), sb[0..4).
void score_tile_portable(const float* qa, const float* qb, const float* k, int64_t stride, int64_t d,
                         float scale, float* sa, float* sb) {
  for (int j = 0; j < 4; ++j) {
    const float* kj = k + j * stride;
    for (int which = 0; which < (qa == qb ? 1 : 2); ++which) {
      const float* q = which == 0 ? qa : qb;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < d; i += 8)
        for (int l = 0; l < 8; ++l) lanes[l] = std::fma(q[i + l], kj[i + l], lanes[l]);
      (which == 0 ? sa : sb)[j] = reduce_lanes(lanes) * scale;
    }
  }
}

#ifdef BLOCKSPEC_X86
// Four keys' reduced lanes at once (hadd pairs the same lanes reduce_lanes pairs):
// [r(c0), r(c1), r(c2), r(c3)].
AVX2 inline __m128 reduce4(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Scores of query q over keys k[0..4) into s[0..4) (the pair tile's arithmetic for one query).
namespace {

AVX2 void score_tile1_avx2(const float* q, const float* k, int64_t stride, int64_t d, float scale,
                           float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + i), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + i), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + i), a3);
  }
  _mm_storeu_ps(s, _mm_mul_ps(reduce4(a0, a1, a2, a3), _mm_set1_ps(scale)));
}

}  // namespace

AVX2 void score_tile_avx2(const float* qa, const float* qb, const float* k, int64_t stride, int64_t d,
                          float scale, float* sa, float* sb) {
  if (qa == qb) return score_tile1_avx2(qa, k, stride, d, scale, sa);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 x = _mm256_loadu_ps(qa + i), y = _mm256_loadu_ps(qb + i);
    const __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + stride + i);
    const __m256 k2 = _mm256_loadu_ps(k + 2 * stride + i), k3 = _mm256_loadu_ps(k + 3 * stride + i);
    a0 = _mm256_fmadd_ps(x, k0, a0), a1 = _mm256_fmadd_ps(x, k1, a1);
    a2 = _mm256_fmadd_ps(x, k2, a2), a3 = _mm256_fmadd_ps(x, k3, a3);
    b0 = _mm256_fmadd_ps(y, k0, b0), b1 = _mm256_fmadd_ps(y, k1, b1);
    b2 = _mm256_fmadd_ps(y, k2, b2), b3 = _mm256_fmadd_ps(y, k3, b3);
  }
  const __m128 sc = _mm_set1_ps(scale);
  _mm_storeu_ps(sa, _mm_mul_ps(reduce4(a0, a1, a2, a3), sc));
  _mm_storeu_ps(sb, _mm_mul_ps(reduce4(b0, b1, b2, b3), sc));
}
#endif

// ---- softmax and V ----------------------------------------------------------------------------------------

// Moves the visible keys' scores (of keys [0, limit)) to the front of s, in key order, with -inf after them
// up to a multiple of 8, and returns their count; `keys` gets their indices, or stays empty where they are
// keys 0..count (all of them, or a causal prefix). A query's sums then run over the same sequence of keys
// wherever hidden ones sit.
int64_t gather_visible(const bool* vis, int64_t limit, float* s, std::vector<int64_t>& keys) {
  keys.clear();
  int64_t count = limit;
  if (vis != nullptr && std::memchr(vis, 0, limit) != nullptr) {  // not a prefix of visible keys
    count = 0;
    for (int64_t j = 0; j < limit; ++j) {
      if (!vis[j]) continue;
      s[count] = s[j];
      keys.push_back(j);
      ++count;
    }
  }
  for (int64_t j = count; j < (count + 7) / 8 * 8; ++j) s[j] = kHidden;
  return count;
}

// s[0..count) (padded with -inf to a multiple of 8) -> exp(s - max) in place; returns 1 / their sum, or 0
// when nothing is visible.
float softmax_portable(float* s, int64_t count) {
  float m = kHidden;
  for (int64_t j = 0; j < count; ++j) m = std::max(m, s[j]);
  if (m == kHidden) return 0.0f;
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    s[j] = exp1(s[j] - m);
    sum += s[j];
  }
  return 1.0f / sum;
}

#ifdef BLOCKSPEC_X86
AVX2 float softmax_avx2(float* s, int64_t count) {
  const int64_t padded = (count + 7) / 8 * 8;
  __m256 mx = _mm256_set1_ps(kHidden);
  for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m = hmax8(mx);
  if (m == kHidden) return 0.0f;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum8(sum);
}

// acc[0..8 P) += p[j] * V row keys[j] (or j) for j in [j0, j1), in order; zero weights add exact zeros,
// skipped. P (d / 8) fixed at compile time keeps the accumulators in registers.
template <int P>
AVX2 void accumulate_avx2(float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                          const float* v, int64_t stride) {
  __m256 a[P];
#pragma GCC unroll 32
  for (int c = 0; c < P; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    if (p[j] == 0.0f) continue;
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + (keys != nullptr ? keys[j] : j) * stride;
#pragma GCC unroll 32
    for (int c = 0; c < P; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), a[c]);
  }
#pragma GCC unroll 32
  for (int c = 0; c < P; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

void accumulate_portable(float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                         const float* v, int64_t stride, int64_t d) {
  for (int64_t j = j0; j < j1; ++j) {
    if (p[j] == 0.0f) continue;
    const float* vj = v + (keys != nullptr ? keys[j] : j) * stride;
    for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p[j], vj[i], acc[i]);
  }
}

void accumulate(bool fast, float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                const float* v, int64_t stride, int64_t d) {
#ifdef BLOCKSPEC_X86
  if (fast) {
    switch (d / 8) {
      case 4: return accumulate_avx2<4>(acc, p, keys, j0, j1, v, stride);
      case 8: return accumulate_avx2<8>(acc, p, keys, j0, j1, v, stride);
      case 16: return accumulate_avx2<16>(acc, p, keys, j0, j1, v, stride);
      case 32: return accumulate_avx2<32>(acc, p, keys, j0, j1, v, stride);
    }
  }
#endif
  accumulate_portable(acc, p, keys, j0, j1, v, stride, d);
}
}  // namespace blockspec_kernels
