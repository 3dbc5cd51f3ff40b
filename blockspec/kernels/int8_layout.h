// The int8 kernels' shared pieces (int8_*.cpp): the packed layout's sizes, a tile's row pointers, where a
// tile's outputs go, and the per-instruction-set group loops the dispatcher (int8_matmul.cpp) calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "int8.h"
#include "simd.h"

namespace blockspec_kernels::int8_detail {

constexpr int kRows = kPackedRows;

// A type's packed record (one block of 32 weights of 8 output rows): its scale section, then its chunks of
// quants, chunk c holding 4 bytes of each of the 8 rows, row after row.
//   nibbles (Q4_0, Q4_1, Q4_K): 4 chunks; a byte's low nibble is weight 4c + j, its high one 16 + 4c + j.
//   bytes (the rest): 8 chunks; byte j of chunk c is weight 4c + j, unsigned (Q5_1, Q5_K: q) or signed
//   stored + 128 (Q8_0: q; Q5_0: q - 16; Q6_K: q - 32).
// Scales, 8 of each side by side: fp16 d; Q4_1/Q5_1: then fp16 m; Q4_K/Q5_K: fp16 d, fp16 dmin, u8 sc,
// u8 mn; Q6_K: fp16 d, int8 scale of weights 0-15, int8 scale of 16-31.
constexpr bool nibbles(int64_t qtype) { return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ4_K; }
constexpr bool signed_bytes(int64_t qtype) { return qtype == kQ8_0 || qtype == kQ5_0 || qtype == kQ6_K; }
constexpr bool k_scales(int64_t qtype) { return qtype == kQ4_K || qtype == kQ5_K; }
constexpr bool has_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1 || k_scales(qtype); }
constexpr int64_t chunk_count(int64_t qtype) { return nibbles(qtype) ? 4 : 8; }
constexpr int64_t scale_bytes(int64_t qtype) {
  return k_scales(qtype) ? 48 : qtype == kQ4_1 || qtype == kQ5_1 || qtype == kQ6_K ? 32 : 16;
}
constexpr int64_t record_bytes(int64_t qtype) { return scale_bytes(qtype) + 32 * chunk_count(qtype); }

// Output o's sub-block in a record and back (int8_pack.cpp): the packed layout holds every stored bit.
void record_to_sub(int64_t qtype, const uint8_t* rec, int o, Sub& sub);
void sub_to_record(int64_t qtype, const Sub& sub, int o, uint8_t* rec);

inline int32_t word_at(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// A tile's R activation rows: their int8 values, block sums, scales and scale x sum.
template <int R>
struct Tile {
  const int8_t* xq[R];
  const int32_t* sums[R];
  const float* d[R];
  const float* ds[R];
};

template <int R>
Tile<R> tile_rows(const Activations& a, int64_t r0) {
  Tile<R> t;
  for (int r = 0; r < R; ++r) {
    t.xq[r] = a.q.data() + (r0 + r) * a.blocks * 32;
    t.sums[r] = a.sum.data() + (r0 + r) * a.blocks;
    t.d[r] = a.d.data() + (r0 + r) * a.blocks;
    t.ds[r] = a.ds.data() + (r0 + r) * a.blocks;
  }
  return t;
}

// Where outputs go: y and the residual (or null) at row 0's first output; at(g): at group g's.
struct Out {
  float* y;
  int64_t ldy;
  const float* res;
  int64_t ldr;
  Out at(int64_t g) const { return {y + g * kRows, ldy, res ? res + g * kRows : nullptr, ldr}; }
};

// Groups [g0, g1) of packed weight w (n outputs, `stride` bytes per group) for activation rows [r0, r1):
// the portable code, the 256-bit kernels (AVX2 or AVX-VNNI), the 512-bit ones (AVX512-VNNI).
void groups_portable(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                     const Activations& a, int64_t r0, int64_t r1, const Out& out);
void groups_ymm(int64_t qtype, Variant v, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                const Activations& a, int64_t r0, int64_t r1, const Out& out);
void groups_zmm(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                const Activations& a, int64_t r0, int64_t r1, const Out& out);

}  // namespace blockspec_kernels::int8_detail
