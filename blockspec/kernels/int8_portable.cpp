// The portable int8 kernel (int8_matmul.cpp has the arithmetic; int8_layout.h the records): the plain C++
// the SIMD kernels (int8_ymm.cpp, int8_zmm.cpp) match bit for bit.

#include <cmath>

#include "int8_layout.h"

namespace blockspec_kernels::int8_detail {
namespace {

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

}  // namespace

void groups_portable(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
                     const Activations& a, int64_t r0, int64_t r1, const Out& out) {
  for (int64_t g = g0; g < g1; ++g) {
    const Out og = out.at(g);
    group_portable(qtype, w + g * stride, a.blocks, a, r0, r1, og.y, og.ldy,
                   std::min<int64_t>(kRows, n - g * kRows), og.res, og.ldr);
  }
}

}  // namespace blockspec_kernels::int8_detail
