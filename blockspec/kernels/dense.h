// The dense fp32 matmul's parts (dense_matmul.cpp): a leaf's chains over a slab of weights, per
// instruction set (dense_leaf.cpp), the transposed copy a row-major weight's slab is read from, and the adds
// of the tree's nodes.
#pragma once

#include <cstdint>

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

// dst[i] = dst[i] + src[i], i < n.
void add_into(Variant v, float* dst, const float* src, int64_t n);

// pack[k * ldp + j] = w[j * ldw + k] for j < width, k < length.
void pack_transposed(Variant v, const float* w, int64_t ldw, int64_t width, int64_t length, float* pack,
                     int64_t ldp);

}  // namespace blockspec_kernels::dense
