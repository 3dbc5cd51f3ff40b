// The 512-bit int8 kernels (AVX512-VNNI): the 256-bit kernels' arithmetic on twice the outputs a register.

#include "int8_layout.h"

// GCC 12's avx512fintrin.h reads its own undefined placeholder registers (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace blockspec_kernels::int8_detail {
#ifdef BLOCKSPEC_X86
namespace {

// Two packed groups side by side make 16 outputs a register: each 32-byte chunk of group g and of g + 1 go
// into the low and high halves, their 8 + 8 scales likewise; then the same integer dots and the same fp32
// steps per lane as the 256-bit kernels (same bits).
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

AVX512 inline __m512i pair_load(const uint8_t* p, int64_t stride) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride)), 1);
}

AVX512 inline __m512 pair_scales(const uint8_t* p, int64_t stride) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1));
}

// 8 bytes of group g and 8 of group g + 1 (`stride` bytes on) as 16 int32 lanes, unsigned or signed.
AVX512 inline __m128i pair_bytes(const uint8_t* p, int64_t stride) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + stride)));
}

// The K-quants' u8 sub-block scales (or mins) of groups g and g + 1 as 16 fp32 lanes.
AVX512 inline __m512 pair_floats(const uint8_t* p, int64_t stride) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pair_bytes(p, stride)));
}

// U units of 16 outputs (groups 2u, 2u + 1 from `panel`, panels `stride` bytes apart) for R rows from r0.
template <int64_t QT, int U, int R>
AVX512 void tile_avx512(const uint8_t* panel, int64_t stride, const Activations& a, int64_t r0, float* y,
                        int64_t ldy, const float* res, int64_t ldr) {
  constexpr int64_t rec = record_bytes(QT), scales = scale_bytes(QT);
  constexpr int kChunks = chunk_count(QT);
  const Tile<R> t = tile_rows<R>(a, r0);
  __m512 acc[U * R];
#pragma GCC unroll 16
  for (int i = 0; i < U * R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0xF), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < a.blocks; ++b) {
    // Two accumulators per dot (low and high nibbles; even and odd byte chunks; Q6_K: its two halves),
    // added at the end: twice the independent dpbusd chains, whose latency a few rows could not hide.
    __m512i dot[U * R], odd[U * R];
#pragma GCC unroll 16
    for (int i = 0; i < U * R; ++i) dot[i] = odd[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const __m512i v = pair_load(panel + 2 * u * stride + b * rec + scales + 32 * c, stride);
        if constexpr (QT == kQ6_K) {  // signed: the sign moved onto the activations, as the 256-bit code
          const __m512i w = _mm512_xor_si512(v, flip);
          const __m512i aw = _mm512_abs_epi8(w);
          const __mmask64 negative = _mm512_movepi8_mask(w);
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
            __m512i& d = c >= 4 ? odd[u * R + r] : dot[u * R + r];
            const __m512i x = _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c));
            const __m512i sx = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            d = _mm512_dpbusd_epi32(d, aw, sx);  // where w is 0, so is aw: x's sign does not matter
          }
        } else if constexpr (!nibbles(QT)) {
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
            __m512i& d = c % 2 ? odd[u * R + r] : dot[u * R + r];
            d = _mm512_dpbusd_epi32(d, v, _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)));
          }
        } else {
          const __m512i lo = _mm512_and_si512(v, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
            dot[u * R + r] = _mm512_dpbusd_epi32(dot[u * R + r], lo,
                                                 _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)));
            odd[u * R + r] = _mm512_dpbusd_epi32(odd[u * R + r], hi,
                                                 _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 16 + 4 * c)));
          }
        }
      }
    }
    if constexpr (QT == kQ6_K) {
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) {
        const uint8_t* p = panel + 2 * u * stride + b * rec;
        const __m512i sa = _mm512_cvtepi8_epi32(pair_bytes(p + 16, stride));
        const __m512i sb = _mm512_cvtepi8_epi32(pair_bytes(p + 24, stride));
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r)
          dot[u * R + r] = _mm512_add_epi32(_mm512_mullo_epi32(dot[u * R + r], sa),
                                            _mm512_mullo_epi32(odd[u * R + r], sb));
      }
    } else {
#pragma GCC unroll 16
      for (int i = 0; i < U * R; ++i) dot[i] = _mm512_add_epi32(dot[i], odd[i]);
    }
    constexpr int32_t offset = QT == kQ6_K ? 0 : signed_bytes(QT) ? 128 : QT == kQ4_0 ? 8 : 0;
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      const uint8_t* p = panel + 2 * u * stride + b * rec;
      __m512 dw = pair_scales(p, stride);
      if constexpr (k_scales(QT)) dw = _mm512_mul_ps(dw, pair_floats(p + 32, stride));
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        __m512i d = dot[u * R + r];
        if constexpr (offset != 0) d = _mm512_sub_epi32(d, _mm512_set1_epi32(offset * t.sums[r][b]));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(t.d[r][b]));
        acc[u * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[u * R + r]);
      }
      if constexpr (has_min(QT)) {
        __m512 mw = pair_scales(p + 16, stride);
        if constexpr (k_scales(QT))
          mw = _mm512_castsi512_ps(
              _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(mw, pair_floats(p + 40, stride))),
                               _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r)
          acc[u * R + r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(t.ds[r][b]), acc[u * R + r]);
      }
    }
  }
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) {
      __m512 v = acc[u * R + r];
      if (res != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(res + (r0 + r) * ldr + 16 * u));
      _mm512_storeu_ps(y + (r0 + r) * ldy + 16 * u, v);
    }
}

// Groups [g0, g1) for rows [r0, r1) on 512-bit registers: one row takes four units (64 outputs) a tile, more
// rows one unit in tiles of up to 8 rows; a group left without a partner takes the AVX2 kernel.
template <int64_t QT>
void groups_avx512(const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1, const Activations& a,
                   int64_t r0, int64_t r1, const Out& out) {
  const int64_t rows = r1 - r0, full = std::min(g1, n / kRows);  // groups below `full` have 8 outputs
  int64_t g = g0;
  if (rows == 1)
    for (; g + 8 <= full; g += 8) {
      const Out o = out.at(g);
      tile_avx512<QT, 4, 1>(w + g * stride, stride, a, r0, o.y, o.ldy, o.res, o.ldr);
    }
  if (rows == 1)
    for (; g + 4 <= full; g += 4) {
      const Out o = out.at(g);
      tile_avx512<QT, 2, 1>(w + g * stride, stride, a, r0, o.y, o.ldy, o.res, o.ldr);
    }
  const int64_t tiles = (rows + 7) / 8;
  for (; g + 2 <= full; g += 2) {
    const Out o = out.at(g);
    for (int64_t i = 0, r = r0; i < tiles; ++i) {
      const int64_t left = rows - (r - r0), count = (left + (tiles - i) - 1) / (tiles - i);
      const uint8_t* panel = w + g * stride;
      switch (count) {
        case 8: tile_avx512<QT, 1, 8>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 7: tile_avx512<QT, 1, 7>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 6: tile_avx512<QT, 1, 6>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 5: tile_avx512<QT, 1, 5>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 4: tile_avx512<QT, 1, 4>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 3: tile_avx512<QT, 1, 3>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 2: tile_avx512<QT, 1, 2>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        default: tile_avx512<QT, 1, 1>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
      }
      r += count;
    }
  }
  if (g < g1) groups_ymm(QT, kAvx2, w, stride, n, g, g1, a, r0, r1, out);
}

}  // namespace
#endif

void groups_zmm(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                const Activations& a, int64_t r0, int64_t r1, const Out& out) {
#ifdef BLOCKSPEC_X86
  switch (qtype) {
    case kQ4_0: return groups_avx512<kQ4_0>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ4_1: return groups_avx512<kQ4_1>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ8_0: return groups_avx512<kQ8_0>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ5_0: return groups_avx512<kQ5_0>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ5_1: return groups_avx512<kQ5_1>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ4_K: return groups_avx512<kQ4_K>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ5_K: return groups_avx512<kQ5_K>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ6_K: return groups_avx512<kQ6_K>(w, stride, n, g0, g1, a, r0, r1, out);
  }
#else
  groups_portable(qtype, w, stride, n, g0, g1, a, r0, r1, out);
#endif
}

}  // namespace blockspec_kernels::int8_detail
