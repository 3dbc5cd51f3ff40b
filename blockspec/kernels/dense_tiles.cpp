// The dense fp32 matmul's register tiles (dense_leaf.cpp chooses them for many rows): every chain of a
// tile's rows and outputs in a register for a whole leaf, the same chains as the streaming passes compute.

#include <algorithm>

#include "dense.h"
#include "simd.h"

// GCC 12's avx512fintrin.h reads its own undefined placeholder registers (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace blockspec_kernels::dense {

#ifdef BLOCKSPEC_X86
namespace {

#define DENSE_AVX512 __attribute__((target("avx2,fma,avx512f")))

constexpr int64_t kAhead = 8;  // inputs ahead whose weights are prefetched

// The leaf for rows r < R and outputs j < width (<= 16 V) with every chain in a register for all its inputs:
// per input V weight vectors and R broadcasts feed R x V multiply-adds (compute-bound row counts).
template <int R, int V>
DENSE_AVX512 void tile512(const float* x, int64_t ldx, const float* w, int64_t ld, int64_t width,
                          int64_t length, float* out, int64_t ldo) {
  __mmask16 m[V];
#pragma GCC unroll 4
  for (int u = 0; u < V; ++u) {
    const int64_t valid = std::clamp<int64_t>(width - 16 * u, 0, 16);
    m[u] = static_cast<__mmask16>((1u << valid) - 1);
  }
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t k = 0; k < length; ++k) {
    __m512 wv[V];
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) {
      wv[u] = _mm512_maskz_loadu_ps(m[u], w + k * ld + 16 * u);
      // Each input's run of a strip is its own page: no hardware prefetcher follows it, so we do.
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAhead) * ld + 16 * u), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int u = 0; u < V; ++u) acc[r][u] = _mm512_fmadd_ps(xr, wv[u], acc[r][u]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) _mm512_mask_storeu_ps(out + r * ldo + 16 * u, m[u], acc[r][u]);
}

template <int R, int V>
AVX2 void tile256(const float* x, int64_t ldx, const float* w, int64_t ld, int64_t width, int64_t length,
                  float* out, int64_t ldo) {
  __m256i m[V];
  bool full = width >= 8 * V;
#pragma GCC unroll 4
  for (int u = 0; u < V; ++u) m[u] = lanes8(width - 8 * u);
  __m256 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) acc[r][u] = _mm256_setzero_ps();
  for (int64_t k = 0; k < length; ++k) {
    __m256 wv[V];
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) {
      wv[u] = full ? _mm256_loadu_ps(w + k * ld + 8 * u) : _mm256_maskload_ps(w + k * ld + 8 * u, m[u]);
      if (u % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAhead) * ld + 8 * u), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int u = 0; u < V; ++u) acc[r][u] = _mm256_fmadd_ps(xr, wv[u], acc[r][u]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) _mm256_maskstore_ps(out + r * ldo + 8 * u, m[u], acc[r][u]);
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
constexpr int kTileRows512 = 6, kTileVectors512 = 4;  // 24 accumulators, 64 outputs
constexpr int kTileRows256 = 4, kTileVectors256 = 3;  // 12 accumulators, 24 outputs
constexpr Tile tiles512[kTileRows512] = {tile512<1, 4>, tile512<2, 4>, tile512<3, 4>, tile512<4, 4>,
                                         tile512<5, 4>, tile512<6, 4>};
constexpr Tile tiles256[kTileRows256] = {tile256<1, 3>, tile256<2, 3>, tile256<3, 3>, tile256<4, 3>};

// The leaf in strips of the tile's outputs, each strip's weights read by every group of rows from L1.
void strips(const Tile* table, int rows_per_tile, int64_t strip, const float* x, int64_t ldx, int64_t rows,
            const Slab& s, int64_t length, float* out, int64_t ldo) {
  for (int64_t j = 0; j < s.width; j += strip)
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_tile) {
      const int64_t group = std::min<int64_t>(rows_per_tile, rows - r0);
      table[group - 1](x + r0 * ldx, ldx, s.w + j, s.ld, std::min(strip, s.width - j), length,
                       out + r0 * ldo + j, ldo);
    }
}

}  // namespace

void leaf_tiles(Variant v, const float* x, int64_t ldx, int64_t rows, const Slab& s, int64_t length,
                float* out, int64_t ldo) {
  if (v == kAvx512) return strips(tiles512, kTileRows512, 16 * kTileVectors512, x, ldx, rows, s, length, out,
                                  ldo);
  strips(tiles256, kTileRows256, 8 * kTileVectors256, x, ldx, rows, s, length, out, ldo);
}
#else
void leaf_tiles(Variant, const float*, int64_t, int64_t, const Slab&, int64_t, float*, int64_t) {}
#endif

}  // namespace blockspec_kernels::dense
