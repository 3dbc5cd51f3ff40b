// A packed block's integer dot products and fp32 steps on 256-bit registers (int8_ymm.cpp's tiles): AVX2
// (maddubs/madd) and AVX-VNNI (dpbusd), the portable kernel's integers and roundings (int8_portable.cpp).
#pragma once

#include "int8_layout.h"

#ifdef BLOCKSPEC_X86
namespace blockspec_kernels::int8_detail {

#define AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// The integer dot products of block b: dot[g * R + r] lane o = the exact dot of output o of group g with
// row r. AVX2: maddubs pairs into int16 (nibbles: up to 8 x 2 x 15 x 127 = 30480, no saturation, summed in
// int16 over the block), then madd to int32. Signed bytes are made signed and their sign moved onto the
// activations (|w| <= 128: 2 x 128 x 127 < 32768); unsigned bytes (<= 31) go in as they are. VNNI: dpbusd
// (u8 weights x s8 activations, int32 sums, no saturation), the weights' offsets taken off with the
// activation block sums; Q6_K keeps the sign move (its halves' sums are not at hand). Q6_K: the two halves'
// dots apart, then each times its int8 scale (|dot| <= 16 x 32 x 127: the products fit int32).
template <int64_t QT, int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void q6_combine(const uint8_t* rec, int64_t stride,
                                                               const __m256i* lo, const __m256i* hi,
                                                               __m256i* dot) {
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const uint8_t* pg = rec + g * stride;
    const __m256i sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pg + 16)));
    const __m256i sb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pg + 24)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      dot[g * R + r] = _mm256_add_epi32(_mm256_mullo_epi32(lo[g * R + r], sa),
                                        _mm256_mullo_epi32(hi[g * R + r], sb));
  }
}

template <int64_t QT, int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void block_dots_avx2(const uint8_t* rec, int64_t stride,
                                                                    const Tile<R>& t, int64_t b,
                                                                    __m256i* dot) {
  const uint8_t* chunks = rec + scale_bytes(QT);
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (!nibbles(QT)) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i hi[G * R];  // Q6_K: the dots of weights 16-31 (others: unused)
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i) dot[i] = hi[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + g * stride + 32 * c));
        if constexpr (signed_bytes(QT)) w = _mm256_xor_si256(w, flip);
        const __m256i aw = signed_bytes(QT) ? _mm256_abs_epi8(w) : w;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m256i x = _mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c));
          if constexpr (signed_bytes(QT)) x = _mm256_sign_epi8(x, w);
          const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);
          __m256i& acc = QT == kQ6_K && c >= 4 ? hi[g * R + r] : dot[g * R + r];
          acc = _mm256_add_epi32(acc, pairs);  // (hi: Q6_K only)
        }
      }
    }
    if constexpr (QT == kQ6_K) q6_combine<QT, G, R>(rec, stride, dot, hi, dot);
  } else {
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256i pairs[G * R];
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i) pairs[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + g * stride + 32 * c));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i xlo = _mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c));
          const __m256i xhi = _mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 16 + 4 * c));
          __m256i& acc = pairs[g * R + r];
          acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(lo, xlo));
          acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(hi, xhi));
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i) {
      dot[i] = _mm256_madd_epi16(pairs[i], ones);
      if constexpr (QT == kQ4_0) dot[i] = _mm256_sub_epi32(dot[i], _mm256_set1_epi32(8 * t.sums[i % R][b]));
    }
  }
}

template <int64_t QT, int G, int R>
VNNI __attribute__((always_inline)) inline void block_dots_vnni(const uint8_t* rec, int64_t stride,
                                                               const Tile<R>& t, int64_t b, __m256i* dot) {
  const uint8_t* chunks = rec + scale_bytes(QT);
#pragma GCC unroll 16
  for (int i = 0; i < G * R; ++i) dot[i] = _mm256_setzero_si256();
  if constexpr (QT == kQ6_K) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i hi[G * R];
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i) hi[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256i w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + g * stride + 32 * c)), flip);
        const __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)), w);
          __m256i& acc = c >= 4 ? hi[g * R + r] : dot[g * R + r];
          acc = _mm256_dpbusd_avx_epi32(acc, aw, x);
        }
      }
    }
    return q6_combine<QT, G, R>(rec, stride, dot, hi, dot);
  } else if constexpr (!nibbles(QT)) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + g * stride + 32 * c));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          dot[g * R + r] = _mm256_dpbusd_avx_epi32(dot[g * R + r], w,
                                                   _mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)));
      }
    }
  } else {
    const __m256i nibble = _mm256_set1_epi8(0xF);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + g * stride + 32 * c));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m256i& acc = dot[g * R + r];
          acc = _mm256_dpbusd_avx_epi32(acc, lo, _mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)));
          acc = _mm256_dpbusd_avx_epi32(acc, hi, _mm256_set1_epi32(word_at(t.xq[r] + b * 32 + 16 + 4 * c)));
        }
      }
    }
  }
  constexpr int32_t offset = signed_bytes(QT) ? 128 : QT == kQ4_0 ? 8 : 0;
  if constexpr (offset != 0) {
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i)
      dot[i] = _mm256_sub_epi32(dot[i], _mm256_set1_epi32(offset * t.sums[i % R][b]));
  }
}

// 8 bytes widened to 8 fp32 lanes (the K-quants' sub-block scales and mins).
AVX2_F16C inline __m256 u8_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Per block, for each group and row: acc = fma(float(dot), d_w * d_x, acc), then for types with a min
// acc = fma(m_w, d_x * sum_x, acc), in that order (scale_portable's steps).
template <int64_t QT, int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void scale_block(const uint8_t* p, int64_t stride,
                                                                const Tile<R>& t, const __m256i* dot,
                                                                int64_t b, __m256* acc) {
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const uint8_t* pg = p + g * stride;
    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg)));
    if constexpr (k_scales(QT)) dw = _mm256_mul_ps(dw, u8_floats(pg + 32));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(t.d[r][b]));
      acc[g * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[g * R + r]), scale, acc[g * R + r]);
    }
    if constexpr (has_min(QT)) {
      __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + 16)));
      if constexpr (k_scales(QT))
        mw = _mm256_xor_ps(_mm256_mul_ps(mw, u8_floats(pg + 40)), _mm256_set1_ps(-0.0f));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[g * R + r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(t.ds[r][b]), acc[g * R + r]);
    }
  }
}

}  // namespace blockspec_kernels::int8_detail
#endif
