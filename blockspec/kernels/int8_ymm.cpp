// The 256-bit int8 kernels (AVX2 maddubs/madd; AVX-VNNI dpbusd): tiles of groups and rows over a packed
// weight, each block's arithmetic in int8_ymm_blocks.h.

#include "int8_ymm_blocks.h"

namespace blockspec_kernels::int8_detail {
namespace {

#ifdef BLOCKSPEC_X86
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
