// The fp32-activation kernel's AVX2 dequantization (quant_matmul.cpp): a 32-weight sub-block of a stored row
// of every type into 4 registers of 8 fp32 weights, element order, the portable reader's values (gguf-py's)
// computed by the same operations (exact products, the same single roundings).
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace blockspec_kernels::dequant_avx2 {

#define BLOCKSPEC_AVX2 __attribute__((target("avx2,fma,f16c")))

// 8 bytes widened to 8 int32 lanes straight from memory (one shuffle; the load folds into it).
BLOCKSPEC_AVX2 inline __m256i widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
BLOCKSPEC_AVX2 inline __m256i widen_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes widened, shifted right by `shift` and masked: 8 quants (or their high bits).
BLOCKSPEC_AVX2 inline __m256i bits_u8(const uint8_t* p, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi32(widen_u8(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}

// A legacy 5-bit block's 32 quants (qs: nibbles, qh: the fifth bits as a u32), 8 per part.
BLOCKSPEC_AVX2 inline void q5_quants(const uint8_t* qs, const uint8_t* qh, __m256i* q) {
  int32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i high = _mm256_set1_epi32(bits);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
  for (int part = 0; part < 4; ++part) {
    const __m256i bit = _mm256_srlv_epi32(high, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * part)));
    q[part] = _mm256_or_si256(bits_u8(qs + 8 * (part % 2), 4 * (part / 2), 0xF),
                              _mm256_slli_epi32(_mm256_and_si256(bit, one), 4));
  }
}

// Sub-block b (32 weights) of a stored row.
template <int64_t QT>
BLOCKSPEC_AVX2 inline void dequant(const uint8_t* row, int64_t b, __m256* w) {
  if constexpr (QT == kF16 || QT == kBF16) {  // converted as they are read (F16C; bf16: a 16-bit shift)
    for (int part = 0; part < 4; ++part) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 64 * b + 16 * part));
      w[part] = QT == kF16 ? _mm256_cvtph_ps(v)
                           : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    const uint8_t* p = row + b * block_bytes(QT);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    __m256i q[4];
    q5_quants(p + (QT == kQ5_0 ? 6 : 8), p + (QT == kQ5_0 ? 2 : 4), q);
    for (int part = 0; part < 4; ++part) {
      if constexpr (QT == kQ5_0) {
        w[part] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[part], _mm256_set1_epi32(16))));
      } else {
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(p + 2)));
        w[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[part]), d, m);
      }
    }
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const uint8_t* p = row + b / 8 * block_bytes(QT);
    const int s = static_cast<int>(b % 8);
    uint8_t sc, mn;
    k_scale_min(p + 4, s, sc, mn);
    const float scale = _cvtsh_ss(load_u16(p)) * static_cast<float>(sc);
    const float min = _cvtsh_ss(load_u16(p + 2)) * static_cast<float>(mn);
    const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(-min);
    const uint8_t* qs = p + (QT == kQ4_K ? 16 : 48) + 32 * (s / 2);
    for (int part = 0; part < 4; ++part) {
      __m256i q = bits_u8(qs + 8 * part, 4 * (s % 2), 0xF);
      if constexpr (QT == kQ5_K)
        q = _mm256_or_si256(q, _mm256_slli_epi32(bits_u8(p + 16 + 8 * part, s, 1), 4));
      w[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), vs, vm);
    }
  } else if constexpr (QT == kQ6_K) {
    const uint8_t* p = row + b / 8 * block_bytes(QT);
    const int s = static_cast<int>(b % 8), h = s / 4;
    const float d = _cvtsh_ss(load_u16(p + 208));
    const __m256 lo = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(p[192 + 2 * s])));
    const __m256 hi = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(p[192 + 2 * s + 1])));
    const uint8_t* ql = p + 64 * h + 32 * (s % 2);
    const uint8_t* qh = p + 128 + 32 * h;
    for (int part = 0; part < 4; ++part) {
      const __m256i q = _mm256_or_si256(bits_u8(ql + 8 * part, 4 * ((s % 4) / 2), 0xF),
                                        _mm256_slli_epi32(bits_u8(qh + 8 * part, 2 * (s % 4), 3), 4));
      w[part] = _mm256_mul_ps(part < 2 ? lo : hi,
                              _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32))));
    }
  } else {
    constexpr int64_t bytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
    const uint8_t* p = row + b * bytes;
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    if constexpr (QT == kQ8_0) {
      for (int part = 0; part < 4; ++part)
        w[part] = _mm256_mul_ps(_mm256_cvtepi32_ps(widen_i8(p + 2 + 8 * part)), d);
    } else {
      const __m256 m = QT == kQ4_1 ? _mm256_set1_ps(_cvtsh_ss(load_u16(p + 2)))
                                   : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
      const uint8_t* q = p + (QT == kQ4_1 ? 4 : 2);
      // Bytes 0-7 and 8-15, each widened once: their low nibbles are elements 0-15, their high ones 16-31.
      const __m256i nibble = _mm256_set1_epi32(0xF);
      const __m256i b0 = widen_u8(q), b1 = widen_u8(q + 8);
      w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble)), d, m);
      w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble)), d, m);
      w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d, m);
      w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d, m);
    }
  }
}

#undef BLOCKSPEC_AVX2

}  // namespace blockspec_kernels::dequant_avx2
#endif
