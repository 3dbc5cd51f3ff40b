// The dense fp32 matmul's parts (dense_matmul.cpp): a leaf's chains over a slab of weights, per
// instruction set (dense_leaf.cpp), the transposed copy a row-major weight's slab is read from, and the adds
// of the tree's nodes.
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace blockspec_kernels::dense {

// Instruction-set variants; all give the same bits. kAuto: the widest this CPU has.
enum Variant : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

// A slab: weight (k, j) of a range of outputs at w[k * ld + j], j < width.
struct Slab {
  const float* w;
  int64_t ld, width;
};

// out[r * ldo + j] (j < s.width, r < rows) = the chain over k < length of acc = fma(x[r * ldx + k],
// s.w[k * s.ld + j], acc) from +0, one per output, in input order.
void leaf_rows(Variant v, const float* x, int64_t ldx, int64_t rows, const Slab& s, int64_t length,
               float* out, int64_t ldo);

// The same, by register tiles (AVX2 or AVX-512 only): for many rows, where the multiply-adds bound the work.
void leaf_tiles(Variant v, const float* x, int64_t ldx, int64_t rows, const Slab& s, int64_t length,
                float* out, int64_t ldo);

// dst[i] = dst[i] + src[i], i < n.
void add_into(Variant v, float* dst, const float* src, int64_t n);

// pack[k * ldp + j] = w[j * ldw + k] for j < width, k < length.
void pack_transposed(Variant v, const float* w, int64_t ldw, int64_t width, int64_t length, float* pack,
                     int64_t ldp);

#ifdef BLOCKSPEC_X86
// An AVX2 mask of the first `valid` of 8 lanes (for maskload / maskstore at a slab's edge).
AVX2 inline __m256i lanes8(int64_t valid) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(valid, 0, 8))), lane);
}
#endif

}  // namespace blockspec_kernels::dense
