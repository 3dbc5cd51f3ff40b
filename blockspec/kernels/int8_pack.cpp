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

}  // namespace blockspec_kernels

namespace blockspec_kernels::int8_detail {

// Signed byte quants are held + 128 (as unsigned); a stored Q5_0 / Q6_K quant q is held as q - 16 / q - 32.
constexpr int bias(int64_t qtype) { return qtype == kQ5_0 ? 128 - 16 : qtype == kQ6_K ? 128 - 32 : 128; }

void sub_to_record(int64_t qtype, const Sub& sub, int o, uint8_t* rec) {
  std::memcpy(rec + 2 * o, &sub.d, 2);
  if (has_min(qtype)) std::memcpy(rec + 16 + 2 * o, &sub.m, 2);
  if (k_scales(qtype)) rec[32 + o] = sub.sc, rec[40 + o] = sub.mn;
  if (qtype == kQ6_K) rec[16 + o] = static_cast<uint8_t>(sub.sa), rec[24 + o] = static_cast<uint8_t>(sub.sb);
  uint8_t* chunks = rec + scale_bytes(qtype);
  for (int c = 0; c < chunk_count(qtype); ++c)
    for (int j = 0; j < 4; ++j) {
      uint8_t& out = chunks[32 * c + 4 * o + j];
      if (nibbles(qtype))
        out = (sub.q[4 * c + j] & 0xF) | (sub.q[16 + 4 * c + j] << 4);
      else
        out = signed_bytes(qtype) ? static_cast<uint8_t>(sub.q[4 * c + j] + bias(qtype)) : sub.q[4 * c + j];
    }
}

void record_to_sub(int64_t qtype, const uint8_t* rec, int o, Sub& sub) {
  sub = Sub{};
  std::memcpy(&sub.d, rec + 2 * o, 2);
  if (has_min(qtype)) std::memcpy(&sub.m, rec + 16 + 2 * o, 2);
  if (k_scales(qtype)) sub.sc = rec[32 + o], sub.mn = rec[40 + o];
  if (qtype == kQ6_K) sub.sa = static_cast<int8_t>(rec[16 + o]), sub.sb = static_cast<int8_t>(rec[24 + o]);
  const uint8_t* chunks = rec + scale_bytes(qtype);
  for (int c = 0; c < chunk_count(qtype); ++c)
    for (int j = 0; j < 4; ++j) {
      const uint8_t v = chunks[32 * c + 4 * o + j];
      if (nibbles(qtype))
        sub.q[4 * c + j] = v & 0xF, sub.q[16 + 4 * c + j] = v >> 4;
      else
        sub.q[4 * c + j] = signed_bytes(qtype) ? static_cast<uint8_t>(v - bias(qtype)) : v;
    }
}

}  // namespace blockspec_kernels::int8_detail

namespace blockspec_kernels {
using namespace int8_detail;

// GGUF blocks [n, k / elems * block_bytes] -> the packed layout [ceil(n / 8), k / 32 * record_bytes].
at::Tensor int8_pack(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blockspec int8_pack: blocks must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(!is_float(qtype), "blockspec int8_pack: F16 / BF16 weights have no int8 form; they take fp32 "
              "activations (quant_matmul)");
  const int64_t bytes = block_bytes(qtype), subs = block_elems(qtype) / 32, n = blocks.size(0);
  const int64_t stored = blocks.size(1) / bytes, nb = stored * subs;
  TORCH_CHECK(blocks.size(1) == stored * bytes, "blockspec int8_pack: rows of ", blocks.size(1),
              " bytes are not whole blocks of ", bytes);
  const int64_t groups = (n + kRows - 1) / kRows, rec = record_bytes(qtype);
  at::Tensor packed = at::zeros({groups, nb * rec}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    Sub sub;
    for (int64_t g = g0; g < g1; ++g)
      for (int o = 0; o < kRows && g * kRows + o < n; ++o)
        for (int64_t b = 0; b < nb; ++b) {
          read_sub(qtype, src + (g * kRows + o) * blocks.size(1) + b / subs * bytes, b % subs, sub);
          sub_to_record(qtype, sub, o, dst + g * nb * rec + b * rec);
        }
  });
  return packed;
}

// The inverse of int8_pack for the first n rows: GGUF blocks [n, k / elems * block_bytes].
at::Tensor int8_unpack(const at::Tensor& packed, int64_t qtype, int64_t n) {
  const int64_t rec = record_bytes(qtype), bytes = block_bytes(qtype), nb = packed.size(1) / rec;
  const int64_t subs = block_elems(qtype) / 32;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  n <= packed.size(0) * kRows && nb % subs == 0,
              "blockspec int8_unpack: packed must be a contiguous uint8 [groups, blocks * record] of >= n "
              "rows");
  const int64_t row_bytes = nb / subs * bytes;
  at::Tensor blocks = at::zeros({n, row_bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = blocks.data_ptr<uint8_t>();
  Sub sub;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t b = 0; b < nb; ++b) {
      record_to_sub(qtype, src + row / kRows * nb * rec + b * rec, static_cast<int>(row % kRows), sub);
      write_sub(qtype, sub, b % subs, dst + row * row_bytes + b / subs * bytes);
    }
  return blocks;
}

// Rows `ids` of the packed weight, dequantized as the stored blocks dequantize: [len(ids), k] fp32.
at::Tensor int8_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t qtype) {
  const int64_t rec = record_bytes(qtype), nb = packed.size(1) / rec;
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), nb * 32}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  Sub sub;
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < packed.size(0) * kRows, "blockspec int8_rows: row ", ip[i],
                " is outside the weight");
    for (int64_t b = 0; b < nb; ++b) {
      record_to_sub(qtype, src + ip[i] / kRows * nb * rec + b * rec, static_cast<int>(ip[i] % kRows), sub);
      dequant_sub(qtype, sub, op + i * nb * 32 + b * 32);
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
