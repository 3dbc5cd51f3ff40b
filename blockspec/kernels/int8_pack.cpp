// The int8 path's data: weights repacked from GGUF blocks into the interleaved layout (and back, and rows
// read from it), and activations quantized to int8 blocks of 32 (see int8_matmul.cpp for both layouts).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "int8_layout.h"
#include "ops.h"

namespace blockspec_kernels {
using namespace int8_detail;
namespace {

// Quantize one block of 32 values: d = amax / 127, q = round-half-even(x * (127 / amax)).
void quantize_block_portable(const float* x, int8_t* q, float& d, int32_t& sum) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  d = amax / 127.0f;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) {
    const float v = std::nearbyint(x[i] * id);
    const int32_t iv = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
    q[i] = static_cast<int8_t>(iv);
    s += iv;
  }
  sum = s;
}

#ifdef BLOCKSPEC_X86
#define AVX2_F16C __attribute__((target("avx2,fma,f16c")))

AVX2_F16C void quantize_block_avx2(const float* x, int8_t* q, float& d, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i iv[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    iv[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
  }
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  sum = _mm_cvtsi128_si32(t);
  // int32 -> int8 in element order: the packs interleave 128-bit lanes, a permute puts them back.
  const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

}  // namespace

void Activations::resize(int64_t rows_, int64_t k) {
  rows = rows_, blocks = k / 32;
  q.resize(rows * k);
  d.resize(rows * blocks), ds.resize(rows * blocks), sum.resize(rows * blocks);
}

void quantize_activation_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, bool simd,
                              Activations& a) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t i = r * a.blocks + b;
      const float* xb = x + (r - r0) * ldx + b * 32;
      int8_t* qb = a.q.data() + i * 32;
#ifdef BLOCKSPEC_X86
      if (simd)
        quantize_block_avx2(xb, qb, a.d[i], a.sum[i]);
      else
#endif
        quantize_block_portable(xb, qb, a.d[i], a.sum[i]);
      a.ds[i] = a.d[i] * static_cast<float>(a.sum[i]);
    }
  }
}

// GGUF blocks [n, k / 32 * block_bytes] -> the packed layout [ceil(n / 8), k / 32 * record_bytes].
at::Tensor int8_pack(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blockspec int8_pack: blocks must be a contiguous 2-D uint8 tensor");
  const int64_t bytes = block_bytes(qtype), n = blocks.size(0), nb = blocks.size(1) / bytes;
  TORCH_CHECK(blocks.size(1) == nb * bytes, "blockspec int8_pack: rows of ", blocks.size(1),
              " bytes are not whole blocks of ", bytes);
  const int64_t groups = (n + kRows - 1) / kRows, rec = record_bytes(qtype);
  at::Tensor packed = at::zeros({groups, nb * rec}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t quant_at = qtype == kQ4_1 ? 4 : 2;  // quants' offset within a stored block
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* out = dst + g * nb * rec + b * rec;
        for (int o = 0; o < kRows && g * kRows + o < n; ++o) {
          const uint8_t* in = src + (g * kRows + o) * nb * bytes + b * bytes;
          std::memcpy(out + 2 * o, in, 2);                            // d
          if (qtype == kQ4_1) std::memcpy(out + 16 + 2 * o, in + 2, 2);  // m
          for (int c = 0; c < chunk_count(qtype); ++c) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t q = in[quant_at + 4 * c + j];
              out[scale_bytes(qtype) + 32 * c + 4 * o + j] = qtype == kQ8_0 ? q ^ 0x80 : q;
            }
          }
        }
      }
    }
  });
  return packed;
}

// The inverse of int8_pack for the first n rows: GGUF blocks [n, k / 32 * block_bytes].
at::Tensor int8_unpack(const at::Tensor& packed, int64_t qtype, int64_t n) {
  const int64_t rec = record_bytes(qtype), bytes = block_bytes(qtype), nb = packed.size(1) / rec;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  n <= packed.size(0) * kRows,
              "blockspec int8_unpack: packed must be a contiguous uint8 [groups, blocks * record] of >= n "
              "rows");
  at::Tensor blocks = at::empty({n, nb * bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = blocks.data_ptr<uint8_t>();
  const int64_t quant_at = qtype == kQ4_1 ? 4 : 2;
  for (int64_t row = 0; row < n; ++row) {
    const int64_t g = row / kRows, o = row % kRows;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* in = src + g * nb * rec + b * rec;
      uint8_t* out = dst + row * nb * bytes + b * bytes;
      std::memcpy(out, in + 2 * o, 2);
      if (qtype == kQ4_1) std::memcpy(out + 2, in + 16 + 2 * o, 2);
      for (int c = 0; c < chunk_count(qtype); ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t q = in[scale_bytes(qtype) + 32 * c + 4 * o + j];
          out[quant_at + 4 * c + j] = qtype == kQ8_0 ? q ^ 0x80 : q;
        }
    }
  }
  return blocks;
}

// Rows `ids` of the packed weight, dequantized: [len(ids), k] fp32 (an embedding lookup).
at::Tensor int8_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t qtype) {
  const int64_t rec = record_bytes(qtype), nb = packed.size(1) / rec;
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), nb * 32}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < packed.size(0) * kRows, "blockspec int8_rows: row ", ip[i],
                " is outside the weight");
    const int64_t g = ip[i] / kRows, o = ip[i] % kRows;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* in = src + g * nb * rec + b * rec;
      const float d = half_to_float(load_u16(in + 2 * o));
      float* w = op + i * nb * 32 + b * 32;
      const uint8_t* chunks = in + scale_bytes(qtype);
      if (qtype == kQ8_0) {
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j)
            w[4 * c + j] = static_cast<float>(static_cast<int32_t>(chunks[32 * c + 4 * o + j]) - 128) * d;
        continue;
      }
      // As the fp32-activation kernel dequantizes: q * d + m (Q4_0: m = -8 d), one rounding.
      const float m = qtype == kQ4_1 ? half_to_float(load_u16(in + 16 + 2 * o)) : -8.0f * d;
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t q = chunks[32 * c + 4 * o + j];
          w[4 * c + j] = std::fma(static_cast<float>(q & 0xF), d, m);
          w[16 + 4 * c + j] = std::fma(static_cast<float>(q >> 4), d, m);
        }
    }
  }
  return out;
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("int8_pack(Tensor blocks, int qtype) -> Tensor");
  m.def("int8_unpack(Tensor packed, int qtype, int n) -> Tensor");
  m.def("int8_rows(Tensor packed, Tensor ids, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("int8_pack", &blockspec_kernels::int8_pack);
  m.impl("int8_unpack", &blockspec_kernels::int8_unpack);
  m.impl("int8_rows", &blockspec_kernels::int8_rows);
}
