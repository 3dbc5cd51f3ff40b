// The int8 kernels' shared pieces (int8_*.cpp): the packed layout's sizes, a tile's row pointers, where a
// tile's outputs go, and the per-instruction-set group loops the dispatcher (int8_matmul.cpp) calls.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int8.h"
#include "simd.h"

namespace blockspec_kernels::int8_detail {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids
constexpr int kRows = kPackedRows;

constexpr int64_t chunk_count(int64_t qtype) { return qtype == kQ8_0 ? 8 : 4; }
constexpr int64_t scale_bytes(int64_t qtype) { return qtype == kQ4_1 ? 32 : 16; }
constexpr int64_t record_bytes(int64_t qtype) { return scale_bytes(qtype) + 32 * chunk_count(qtype); }

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

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
