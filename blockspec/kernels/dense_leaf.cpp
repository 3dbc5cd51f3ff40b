// The dense fp32 matmul's inner loops (see dense_matmul.cpp for the order they keep). Each output's leaf is
// one chain acc = fma(x_k, w_k, acc) from +0 in input order, one vector lane per output, computed one of two
// ways with the same bits. Few rows (a decode step, a verify block): bound by streaming the weights, so the
// partial sums live in `out` (L1) and a pass takes 4-8 inputs' weights as stored, contiguous runs of a
// slab's outputs, for up to 4 rows, loading each row's sums once per pass. Many rows (prefill): bound by the
// multiply-adds, so register tiles hold every chain for the whole leaf. The portable, AVX2 and AVX-512 loops
// compute the same chains, bit for bit. Also the transposes that copy a row-major weight's slab into the
// column-major form the chains read, and the adds of the tree's nodes.

#include <algorithm>
#include <cmath>

#include "dense.h"
#include "simd.h"

// GCC 12's avx512fintrin.h reads its own undefined placeholder registers (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace blockspec_kernels::dense {
namespace {

constexpr int kRows = 4;    // rows a pass carries
constexpr int kInputs = 8;  // inputs a pass takes, at most: 8 for 1-2 rows, else 4 (for the broadcasts)
constexpr int64_t kTiledRows = 12;  // from this many rows, the register tiles

void leaf_portable(const float* x, int64_t ldx, int64_t rows, const Slab& s, int64_t length, float* out,
                   int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldo;
    std::fill(o, o + s.width, 0.0f);
    for (int64_t k = 0; k < length; ++k) {
      const float xv = x[r * ldx + k];
      const float* wk = s.w + k * s.ld;
      for (int64_t j = 0; j < s.width; ++j) o[j] = std::fma(xv, wk[j], o[j]);
    }
  }
}

#ifdef BLOCKSPEC_X86
#define DENSE_AVX512 __attribute__((target("avx2,fma,avx512f")))

// Inputs k0 .. k0 + K of rows r < R: o_r[j] = fma(x_r,k, w_k[j], o_r[j]) in k order (from +0 when `first`).
template <int R, int K>
DENSE_AVX512 void pass512(const float* x, int64_t ldx, const float* w, int64_t ld, int64_t width,
                          bool first, float* out, int64_t ldo) {
  __m512 xb[R][K];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) xb[r][i] = _mm512_set1_ps(x[r * ldx + i]);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = width - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - j)) - 1);
    __m512 wv[K];
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) wv[i] = _mm512_maskz_loadu_ps(m, w + i * ld + j);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* o = out + r * ldo + j;
      __m512 acc = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, o);
#pragma GCC unroll 8
      for (int i = 0; i < K; ++i) acc = _mm512_fmadd_ps(xb[r][i], wv[i], acc);
      _mm512_mask_storeu_ps(o, m, acc);
    }
  }
}

template <int R, int K, bool Tail>
AVX2 inline void column8(const __m256 (&xb)[R][K], const float* w, int64_t ld, int64_t j, __m256i m,
                         bool first, float* out, int64_t ldo) {
  __m256 wv[K];
#pragma GCC unroll 4
  for (int i = 0; i < K; ++i)
    wv[i] = Tail ? _mm256_maskload_ps(w + i * ld + j, m) : _mm256_loadu_ps(w + i * ld + j);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo + j;
    __m256 acc = first ? _mm256_setzero_ps() : Tail ? _mm256_maskload_ps(o, m) : _mm256_loadu_ps(o);
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) acc = _mm256_fmadd_ps(xb[r][i], wv[i], acc);
    if (Tail)
      _mm256_maskstore_ps(o, m, acc);
    else
      _mm256_storeu_ps(o, acc);
  }
}

template <int R, int K>
AVX2 void pass256(const float* x, int64_t ldx, const float* w, int64_t ld, int64_t width, bool first,
                  float* out, int64_t ldo) {
  __m256 xb[R][K];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) xb[r][i] = _mm256_set1_ps(x[r * ldx + i]);
  int64_t j = 0;
  for (; j + 8 <= width; j += 8) column8<R, K, false>(xb, w, ld, j, __m256i{}, first, out, ldo);
  if (j < width) column8<R, K, true>(xb, w, ld, j, lanes8(width - j), first, out, ldo);
}

using Pass = void (*)(const float*, int64_t, const float*, int64_t, int64_t, bool, float*, int64_t);

template <template <int, int> class P>
constexpr Pass passes[kRows][kInputs] = {
    {P<1, 1>::run, P<1, 2>::run, P<1, 3>::run, P<1, 4>::run, P<1, 5>::run, P<1, 6>::run, P<1, 7>::run,
     P<1, 8>::run},
    {P<2, 1>::run, P<2, 2>::run, P<2, 3>::run, P<2, 4>::run, P<2, 5>::run, P<2, 6>::run, P<2, 7>::run,
     P<2, 8>::run},
    {P<3, 1>::run, P<3, 2>::run, P<3, 3>::run, P<3, 4>::run},
    {P<4, 1>::run, P<4, 2>::run, P<4, 3>::run, P<4, 4>::run},
};

template <int R, int K>
struct Zmm {
  static void run(const float* x, int64_t ldx, const float* w, int64_t ld, int64_t n, bool f, float* o,
                  int64_t ldo) {
    pass512<R, K>(x, ldx, w, ld, n, f, o, ldo);
  }
};

template <int R, int K>
struct Ymm {
  static void run(const float* x, int64_t ldx, const float* w, int64_t ld, int64_t n, bool f, float* o,
                  int64_t ldo) {
    pass256<R, K>(x, ldx, w, ld, n, f, o, ldo);
  }
};

// The leaf in passes of a few inputs; within one, rows in groups of kRows (the group's weights are re-read
// from L1).
void leaf_simd(const Pass (&table)[kRows][kInputs], const float* x, int64_t ldx, int64_t rows,
               const Slab& s, int64_t length, float* out, int64_t ldo) {
  const int64_t step = rows <= 2 ? 8 : 4;
  for (int64_t k0 = 0; k0 < length; k0 += step) {
    const int64_t inputs = std::min<int64_t>(step, length - k0);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t group = std::min<int64_t>(kRows, rows - r0);
      table[group - 1][inputs - 1](x + r0 * ldx + k0, ldx, s.w + k0 * s.ld, s.ld, s.width, k0 == 0,
                                   out + r0 * ldo, ldo);
    }
  }
  if (length == 0)
    for (int64_t r = 0; r < rows; ++r) std::fill(out + r * ldo, out + r * ldo + s.width, 0.0f);
}

// o[i] = column i of the 8 x 8 block r[0..7] (rows of 8).
AVX2 inline void transpose8(const __m256 r[8], __m256 o[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    __m256* q = t + 4 * h;
    s[4 * h] = _mm256_shuffle_ps(q[0], q[2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(q[0], q[2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(q[1], q[3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(q[1], q[3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    o[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    o[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

AVX2 void pack_avx2(const float* w, int64_t ldw, int64_t width, int64_t length, float* pack, int64_t ldp) {
  const int64_t j8 = width / 8 * 8, k8 = length / 8 * 8;
  for (int64_t j = 0; j < j8; j += 8)
    for (int64_t k = 0; k < k8; k += 8) {
      __m256 r[8], o[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(w + (j + i) * ldw + k);
      transpose8(r, o);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(pack + (k + i) * ldp + j, o[i]);
    }
  for (int64_t j = 0; j < width; ++j)  // the edges
    for (int64_t k = j < j8 ? k8 : 0; k < length; ++k) pack[k * ldp + j] = w[j * ldw + k];
}

AVX2 void add_avx2(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = dst[i] + src[i];
}
#endif

}  // namespace

void leaf_rows(Variant v, const float* x, int64_t ldx, int64_t rows, const Slab& s, int64_t length,
               float* out, int64_t ldo) {
#ifdef BLOCKSPEC_X86
  // Which loop is measured choice (scripts/dense_kernel_bench.py): the same chains either way.
  if (v != kPortable && rows >= kTiledRows) return leaf_tiles(v, x, ldx, rows, s, length, out, ldo);
  if (v == kAvx512) return leaf_simd(passes<Zmm>, x, ldx, rows, s, length, out, ldo);
  if (v == kAvx2) return leaf_simd(passes<Ymm>, x, ldx, rows, s, length, out, ldo);
#endif
  leaf_portable(x, ldx, rows, s, length, out, ldo);
}

void add_into(Variant v, float* dst, const float* src, int64_t n) {
#ifdef BLOCKSPEC_X86
  if (v != kPortable) return add_avx2(dst, src, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
}

void pack_transposed(Variant v, const float* w, int64_t ldw, int64_t width, int64_t length, float* pack,
                     int64_t ldp) {
#ifdef BLOCKSPEC_X86
  if (v != kPortable) return pack_avx2(w, ldw, width, length, pack, ldp);
#endif
  for (int64_t j = 0; j < width; ++j)
    for (int64_t k = 0; k < length; ++k) pack[k * ldp + j] = w[j * ldw + k];
}

}  // namespace blockspec_kernels::dense
