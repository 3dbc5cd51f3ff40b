// The 256-bit int8 kernels (AVX2 maddubs/madd; AVX-VNNI dpbusd) and the portable code they match bit for bit.

#include "int8_layout.h"

namespace blockspec_kernels::int8_detail {
namespace {

// ---- portable kernel ----------------------------------------------------------------------------------

// The exact integer dot of block b of packed output `o` (0..7 within its group) with activation block xq
// (Q6_K: each half's dot times its scale), and the fp32 steps that follow it.
int32_t block_dot_portable(int64_t qtype, const uint8_t* rec, int o, const int8_t* xq) {
  const uint8_t* chunks = rec + scale_bytes(qtype);
  const int32_t offset = qtype == kQ4_0 ? 8 : 0;
  int32_t lo = 0, hi = 0;
  for (int c = 0; c < chunk_count(qtype); ++c) {
    const uint8_t* w = chunks + 32 * c + 4 * o;
    for (int j = 0; j < 4; ++j) {
      if (nibbles(qtype)) {
        lo += ((w[j] & 0xF) - offset) * xq[4 * c + j];
        lo += ((w[j] >> 4) - offset) * xq[16 + 4 * c + j];
      } else {
        (c < 4 ? lo : hi) += (signed_bytes(qtype) ? w[j] - 128 : w[j]) * xq[4 * c + j];
      }
    }
  }
  if (qtype == kQ6_K) return static_cast<int8_t>(rec[16 + o]) * lo + static_cast<int8_t>(rec[24 + o]) * hi;
  return lo + hi;
}

// acc = fma(float(dot), d_w * d_x, acc), the K-quants' d_w being d * sc; then, for types with a min,
// acc = fma(m_w, d_x * sum_x, acc) with m_w = m (Q4_1, Q5_1) or -(dmin * mn) (Q4_K, Q5_K).
float scale_portable(int64_t qtype, const uint8_t* rec, int o, int32_t dot, float dx, float dsx, float acc) {
  float dw = half_to_float(load_u16(rec + 2 * o));
  if (k_scales(qtype)) dw *= static_cast<float>(rec[32 + o]);
  acc = std::fma(static_cast<float>(dot), dw * dx, acc);
  if (has_min(qtype)) {
    float m = half_to_float(load_u16(rec + 16 + 2 * o));
    if (k_scales(qtype)) m = -(m * static_cast<float>(rec[40 + o]));
    acc = std::fma(m, dsx, acc);
  }
  return acc;
}

void group_portable(int64_t qtype, const uint8_t* panel, int64_t blocks, const Activations& a, int64_t r0,
                    int64_t r1, float* y, int64_t ldy, int64_t outputs, const float* res, int64_t ldr) {
  const int64_t rec = record_bytes(qtype);
  for (int64_t r = r0; r < r1; ++r) {
    for (int o = 0; o < outputs; ++o) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = panel + b * rec;
        const int64_t i = r * blocks + b;
        const int32_t dot = block_dot_portable(qtype, p, o, a.q.data() + r * blocks * 32 + b * 32);
        acc = scale_portable(qtype, p, o, dot, a.d[i], a.ds[i], acc);
      }
      y[r * ldy + o] = res != nullptr ? acc + res[r * ldr + o] : acc;
    }
  }
}

#ifdef BLOCKSPEC_X86
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

// The tile's outputs, each plus its residual if there is one (read before the store: y may be res).
template <int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void store_tile(
    const __m256* acc, float* y, int64_t ldy, int64_t outputs, const float* res, int64_t ldr) {
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) {
      float* out = y + r * ldy + g * kRows;
      if (outputs == kRows) {
        __m256 v = acc[g * R + r];
        if (res != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(res + r * ldr + g * kRows));
        _mm256_storeu_ps(out, v);
      } else {  // a last group of fewer than 8 outputs (G is 1 there)
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[g * R + r]);
        for (int64_t o = 0; o < outputs; ++o)
          out[o] = res != nullptr ? lanes[o] + res[r * ldr + o] : lanes[o];
      }
    }
  }
}

// G groups from `panel` (stride bytes apart) for R rows from r0, every block; y at row r0, group 0's outputs.
// One copy per instruction set, so each holds only its own instructions.
#define BLOCKSPEC_TILE(NAME, TARGET, DOTS)                                                                \
  template <int64_t QT, int G, int R>                                                                     \
  TARGET void NAME(const uint8_t* panel, int64_t stride, const Activations& a, int64_t r0, float* y,      \
                   int64_t ldy, int64_t outputs, const float* res, int64_t ldr) {                         \
    const Tile<R> t = tile_rows<R>(a, r0);                                                          \
    __m256 acc[G * R];                                                                                    \
    for (int i = 0; i < G * R; ++i) acc[i] = _mm256_setzero_ps();                                         \
    for (int64_t b = 0; b < a.blocks; ++b) {                                                              \
      const uint8_t* p = panel + b * record_bytes(QT);                                                    \
      __m256i dot[G * R];                                                                                 \
      DOTS<QT, G, R>(p, stride, t, b, dot);                                                               \
      scale_block<QT, G, R>(p, stride, t, dot, b, acc);                                                   \
    }                                                                                                     \
    store_tile<G, R>(acc, y + r0 * ldy, ldy, outputs, res ? res + r0 * ldr : nullptr, ldr);               \
  }
BLOCKSPEC_TILE(tile_avx2, AVX2_F16C, block_dots_avx2)
BLOCKSPEC_TILE(tile_vnni, VNNI, block_dots_vnni)
#undef BLOCKSPEC_TILE

template <int64_t QT, Variant V, int G, int R>
inline void tile(const uint8_t* panel, int64_t stride, const Activations& a, int64_t r0, const Out& o,
                 int64_t outputs) {
  if constexpr (V == kVnni)
    tile_vnni<QT, G, R>(panel, stride, a, r0, o.y, o.ldy, outputs, o.res, o.ldr);
  else
    tile_avx2<QT, G, R>(panel, stride, a, r0, o.y, o.ldy, outputs, o.res, o.ldr);
}

// Groups [g0, g1) for rows [r0, r1): one row takes 4 groups a tile, two rows 2, more rows one group in
// tiles of up to 5 rows (the registers' limit), as even as the count allows.
template <int64_t QT, Variant V>
void groups_simd(const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1, const Activations& a,
                 int64_t r0, int64_t r1, const Out& out) {
  const int64_t rows = r1 - r0, full = n / kRows;  // groups below `full` have 8 outputs
  int64_t g = g0;
  if (rows == 1)
    for (; g + 4 <= std::min(g1, full); g += 4)
      tile<QT, V, 4, 1>(w + g * stride, stride, a, r0, out.at(g), kRows);
  if (rows == 2)
    for (; g + 2 <= std::min(g1, full); g += 2)
      tile<QT, V, 2, 2>(w + g * stride, stride, a, r0, out.at(g), kRows);
  for (; g < g1; ++g) {
    const int64_t outputs = std::min<int64_t>(kRows, n - g * kRows);
    const uint8_t* panel = w + g * stride;
    const Out og = out.at(g);
    const int64_t tiles = (rows + 4) / 5;
    for (int64_t i = 0, r = r0; i < tiles; ++i) {
      const int64_t left = rows - (r - r0), count = (left + (tiles - i) - 1) / (tiles - i);
      switch (count) {
        case 5: tile<QT, V, 1, 5>(panel, stride, a, r, og, outputs); break;
        case 4: tile<QT, V, 1, 4>(panel, stride, a, r, og, outputs); break;
        case 3: tile<QT, V, 1, 3>(panel, stride, a, r, og, outputs); break;
        case 2: tile<QT, V, 1, 2>(panel, stride, a, r, og, outputs); break;
        default: tile<QT, V, 1, 1>(panel, stride, a, r, og, outputs); break;
      }
      r += count;
    }
  }
}

template <Variant V>
void groups_of(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
               const Activations& a, int64_t r0, int64_t r1, const Out& out) {
  switch (qtype) {
    case kQ4_0: return groups_simd<kQ4_0, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ4_1: return groups_simd<kQ4_1, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ8_0: return groups_simd<kQ8_0, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ5_0: return groups_simd<kQ5_0, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ5_1: return groups_simd<kQ5_1, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ4_K: return groups_simd<kQ4_K, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ5_K: return groups_simd<kQ5_K, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ6_K: return groups_simd<kQ6_K, V>(w, stride, n, g0, g1, a, r0, r1, out);
  }
}
#endif

}  // namespace

void groups_portable(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                     const Activations& a, int64_t r0, int64_t r1, const Out& out) {
  for (int64_t g = g0; g < g1; ++g) {
    const Out og = out.at(g);
    group_portable(qtype, w + g * stride, a.blocks, a, r0, r1, og.y, og.ldy,
                   std::min<int64_t>(kRows, n - g * kRows), og.res, og.ldr);
  }
}

void groups_ymm(int64_t qtype, Variant v, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                const Activations& a, int64_t r0, int64_t r1, const Out& out) {
#ifdef BLOCKSPEC_X86
  if (v == kVnni) return groups_of<kVnni>(qtype, w, stride, n, g0, g1, a, r0, r1, out);
  return groups_of<kAvx2>(qtype, w, stride, n, g0, g1, a, r0, r1, out);
#else
  groups_portable(qtype, w, stride, n, g0, g1, a, r0, r1, out);
#endif
}

}  // namespace blockspec_kernels::int8_detail
