// y = x W^T for GGUF block weights (Q4_0, Q4_1, Q8_0) with int8 activations: each activation row is quantized
// once per matmul into blocks of 32 int8 values with an fp32 scale (and the block's sum), and every block dot
// product runs in integers (AVX2_F16C maddubs/madd, or VNNI dpbusd), exact; only the per-block scaling and the sum
// over blocks are fp32. Weights are repacked once at load: 8 output rows interleaved in 4-byte groups, so one
// 256-bit register holds 4 weights of each of 8 outputs, an activation group of 4 bytes is broadcast against
// it, and each 32-bit lane accumulates one output: 8 outputs per register, no horizontal sums.
//
// Exactness and batch invariance: a row's quantization depends on that row alone; a block's integer dot is
// exact whatever the instruction set; then for each output, block by block in order,
//   acc = fma(float(dot_b), d_w,b * d_x,b, acc)   (Q4_1 also: acc = fma(m_w,b, d_x,b * sum_x,b, acc))
// starting from 0. Every variant (portable, AVX2, AVX-VNNI / AVX512-VNNI) computes exactly that sequence, so
// results are bit-identical across variants, row counts, row positions and thread counts.
//
// Packed layout (per group of 8 output rows, block after block; rows padded to a multiple of 8 with zeros):
//   Q4_0: 8 fp16 d, then 4 chunks of 32 bytes;           Q4_1: 8 fp16 d, 8 fp16 m, then 4 chunks;
//   Q8_0: 8 fp16 d, then 8 chunks of 32 bytes (each weight + 128, as unsigned).
// Chunk c holds bytes 4c..4c+3 of each of the 8 rows' stored quants, row after row. For Q4 a stored byte j
// holds weight j (low nibble) and weight j + 16 (high nibble), so chunk c's low nibbles are weights 4c..4c+3 and
// its high nibbles weights 16+4c..16+4c+3; for Q8, chunk c is weights 4c..4c+3.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include "int8.h"
#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>


namespace blockspec_kernels {
namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int kRows = kPackedRows;

constexpr int64_t chunk_count(int64_t qtype) { return qtype == kQ8_0 ? 8 : 4; }
constexpr int64_t scale_bytes(int64_t qtype) { return qtype == kQ4_1 ? 32 : 16; }
constexpr int64_t record_bytes(int64_t qtype) { return scale_bytes(qtype) + 32 * chunk_count(qtype); }

int64_t stored_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "blockspec int8 matmul: unsupported GGML type id ", qtype,
              "; supported: 2 (Q4_0), 3 (Q4_1), 8 (Q8_0)");
  return 0;
}

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ---- activations ----------------------------------------------------------------------------------------

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

void quantize_activation_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, bool simd, Activations& a) {
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

namespace {

// ---- portable kernel ----------------------------------------------------------------------------------

// The exact integer dot of block b of packed output `o` (0..7 within its group) with activation block xq.
int32_t block_dot_portable(int64_t qtype, const uint8_t* rec, int o, const int8_t* xq) {
  const uint8_t* chunks = rec + scale_bytes(qtype);
  int32_t dot = 0;
  for (int c = 0; c < chunk_count(qtype); ++c) {
    const uint8_t* w = chunks + 32 * c + 4 * o;
    for (int j = 0; j < 4; ++j) {
      if (qtype == kQ8_0) {
        dot += (static_cast<int32_t>(w[j]) - 128) * xq[4 * c + j];
      } else {
        const int32_t offset = qtype == kQ4_0 ? 8 : 0;
        dot += ((w[j] & 0xF) - offset) * xq[4 * c + j];
        dot += ((w[j] >> 4) - offset) * xq[16 + 4 * c + j];
      }
    }
  }
  return dot;
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
        const float scale = half_to_float(load_u16(p + 2 * o)) * a.d[i];
        acc = std::fma(static_cast<float>(dot), scale, acc);
        if (qtype == kQ4_1) acc = std::fma(half_to_float(load_u16(p + 16 + 2 * o)), a.ds[i], acc);
      }
      y[r * ldy + o] = res != nullptr ? acc + res[r * ldr + o] : acc;
    }
  }
}

// ---- SIMD kernels ---------------------------------------------------------------------------------------

#ifdef BLOCKSPEC_X86
#define VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// A tile: G consecutive groups of 8 outputs (panels `stride` bytes apart) times R activation rows. Several
// groups per tile give one activation row independent accumulation chains (a block's dpbusd chain is its
// latency otherwise); several rows per tile unpack each weight register once for all of them.
template <int G, int R>
struct Tile {
  const int8_t* xq[R];
  const int32_t* sums[R];
  const float* d[R];
  const float* ds[R];
};

template <int G, int R>
Tile<G, R> tile_rows(const Activations& a, int64_t r0) {
  Tile<G, R> t;
  for (int r = 0; r < R; ++r) {
    t.xq[r] = a.q.data() + (r0 + r) * a.blocks * 32;
    t.sums[r] = a.sum.data() + (r0 + r) * a.blocks;
    t.d[r] = a.d.data() + (r0 + r) * a.blocks;
    t.ds[r] = a.ds.data() + (r0 + r) * a.blocks;
  }
  return t;
}

inline int32_t word_at(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The integer dot products of block b: dot[g * R + r] lane o = the exact dot of output o of group g with
// row r. AVX2: maddubs pairs into int16 (Q4: up to 8 x 2 x 15 x 127 = 30480, no saturation, summed in int16
// over the block), then madd to int32; Q8 weights are made signed and their sign moved onto the activations
// (|w| <= 128: 2 x 128 x 127 < 32768). VNNI: dpbusd (u8 weights x s8 activations, int32 sums, no saturation),
// the weights' offsets taken off with the activation block sums.
template <int64_t QT, int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void block_dots_avx2(const uint8_t* chunks, int64_t stride,
                                                                    const Tile<G, R>& t, int64_t b,
                                                                    __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (QT == kQ8_0) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i) dot[i] = _mm256_setzero_si256();
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
          dot[g * R + r] = _mm256_add_epi32(dot[g * R + r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
        }
      }
    }
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
VNNI __attribute__((always_inline)) inline void block_dots_vnni(const uint8_t* chunks, int64_t stride,
                                                               const Tile<G, R>& t, int64_t b, __m256i* dot) {
#pragma GCC unroll 16
  for (int i = 0; i < G * R; ++i) dot[i] = _mm256_setzero_si256();
  if constexpr (QT == kQ8_0) {
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
  constexpr int32_t offset = QT == kQ8_0 ? 128 : QT == kQ4_0 ? 8 : 0;
  if constexpr (offset != 0) {
#pragma GCC unroll 16
    for (int i = 0; i < G * R; ++i)
      dot[i] = _mm256_sub_epi32(dot[i], _mm256_set1_epi32(offset * t.sums[i % R][b]));
  }
}


// Per block, for each group and row: acc += float(dot) * (d_w * d_x) (and for Q4_1: acc += m_w * (d_x *
// sum_x)), in that order.
template <int64_t QT, int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void scale_block(const uint8_t* p, int64_t stride,
                                                                const Tile<G, R>& t, const __m256i* dot,
                                                                int64_t b, __m256* acc) {
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const uint8_t* pg = p + g * stride;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(t.d[r][b]));
      acc[g * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[g * R + r]), scale, acc[g * R + r]);
    }
    if constexpr (QT == kQ4_1) {
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + 16)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[g * R + r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(t.ds[r][b]), acc[g * R + r]);
    }
  }
}

// The tile's outputs, each plus its residual if there is one (read before the store: y may be res).
template <int G, int R>
AVX2_F16C __attribute__((always_inline)) inline void store_tile(const __m256* acc, float* y, int64_t ldy,
                                                               int64_t outputs, const float* res, int64_t ldr) {
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
        for (int64_t o = 0; o < outputs; ++o) out[o] = res != nullptr ? lanes[o] + res[r * ldr + o] : lanes[o];
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
    const Tile<G, R> t = tile_rows<G, R>(a, r0);                                                          \
    __m256 acc[G * R];                                                                                    \
    for (int i = 0; i < G * R; ++i) acc[i] = _mm256_setzero_ps();                                         \
    for (int64_t b = 0; b < a.blocks; ++b) {                                                              \
      const uint8_t* p = panel + b * record_bytes(QT);                                                    \
      __m256i dot[G * R];                                                                                 \
      DOTS<QT, G, R>(p + scale_bytes(QT), stride, t, b, dot);                                             \
      scale_block<QT, G, R>(p, stride, t, dot, b, acc);                                                   \
    }                                                                                                     \
    store_tile<G, R>(acc, y + r0 * ldy, ldy, outputs, res ? res + r0 * ldr : nullptr, ldr);               \
  }
BLOCKSPEC_TILE(tile_avx2, AVX2_F16C, block_dots_avx2)
BLOCKSPEC_TILE(tile_vnni, VNNI, block_dots_vnni)
#undef BLOCKSPEC_TILE

// Where a tile's outputs go: y and the residual (or null), both at group g0's outputs of row 0.
struct Out {
  float* y;
  int64_t ldy;
  const float* res;
  int64_t ldr;
  Out at(int64_t g) const { return {y + g * kRows, ldy, res ? res + g * kRows : nullptr, ldr}; }
};

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

// ---- AVX512-VNNI on 512-bit registers ---------------------------------------------------------------------

// Two packed groups side by side make 16 outputs a register: each 32-byte chunk of group g and of g + 1 go into
// the low and high halves, their 8 + 8 scales likewise; then the same integer dots and the same fp32 steps per
// lane as the 256-bit kernels (same bits).
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

AVX512 inline __m512i pair_load(const uint8_t* p, int64_t stride) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride)), 1);
}

AVX512 inline __m512 pair_scales(const uint8_t* p, int64_t stride) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1));
}

// U units of 16 outputs (groups 2u, 2u + 1 from `panel`, panels `stride` bytes apart) for R rows from r0.
template <int64_t QT, int U, int R>
AVX512 void tile_avx512(const uint8_t* panel, int64_t stride, const Activations& a, int64_t r0, float* y,
                        int64_t ldy, const float* res, int64_t ldr) {
  constexpr int64_t rec = record_bytes(QT), scales = scale_bytes(QT);
  const Tile<1, R> t = tile_rows<1, R>(a, r0);
  __m512 acc[U * R];
#pragma GCC unroll 16
  for (int i = 0; i < U * R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0xF);
  for (int64_t b = 0; b < a.blocks; ++b) {
    // Two accumulators per dot (low and high nibbles; even and odd Q8 chunks), added at the end: twice the
    // independent dpbusd chains, whose latency a few rows could not hide.
    __m512i dot[U * R], odd[U * R];
#pragma GCC unroll 16
    for (int i = 0; i < U * R; ++i) dot[i] = odd[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < chunk_count(QT); ++c) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const __m512i v = pair_load(panel + 2 * u * stride + b * rec + scales + 32 * c, stride);
        if constexpr (QT == kQ8_0) {
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
            __m512i& d = c % 2 ? odd[u * R + r] : dot[u * R + r];
            d = _mm512_dpbusd_epi32(d, v, _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)));
          }
        } else {
          const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
            dot[u * R + r] = _mm512_dpbusd_epi32(dot[u * R + r], lo,
                                                 _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 4 * c)));
            odd[u * R + r] = _mm512_dpbusd_epi32(odd[u * R + r], hi,
                                                 _mm512_set1_epi32(word_at(t.xq[r] + b * 32 + 16 + 4 * c)));
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < U * R; ++i) dot[i] = _mm512_add_epi32(dot[i], odd[i]);
    constexpr int32_t offset = QT == kQ8_0 ? 128 : QT == kQ4_0 ? 8 : 0;
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      const uint8_t* p = panel + 2 * u * stride + b * rec;
      const __m512 dw = pair_scales(p, stride);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        __m512i d = dot[u * R + r];
        if constexpr (offset != 0) d = _mm512_sub_epi32(d, _mm512_set1_epi32(offset * t.sums[r][b]));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(t.d[r][b]));
        acc[u * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[u * R + r]);
      }
      if constexpr (QT == kQ4_1) {
        const __m512 mw = pair_scales(p + 16, stride);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r)
          acc[u * R + r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(t.ds[r][b]), acc[u * R + r]);
      }
    }
  }
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) {
      __m512 v = acc[u * R + r];
      if (res != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(res + (r0 + r) * ldr + 16 * u));
      _mm512_storeu_ps(y + (r0 + r) * ldy + 16 * u, v);
    }
}

// Groups [g0, g1) for rows [r0, r1) on 512-bit registers: one row takes four units (64 outputs) a tile, more
// rows one unit in tiles of up to 8 rows; a group left without a partner takes the AVX2 kernel.
template <int64_t QT>
void groups_avx512(const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1, const Activations& a,
                   int64_t r0, int64_t r1, const Out& out) {
  const int64_t rows = r1 - r0, full = std::min(g1, n / kRows);  // groups below `full` have 8 outputs
  int64_t g = g0;
  if (rows == 1)
    for (; g + 8 <= full; g += 8) {
      const Out o = out.at(g);
      tile_avx512<QT, 4, 1>(w + g * stride, stride, a, r0, o.y, o.ldy, o.res, o.ldr);
    }
  if (rows == 1)
    for (; g + 4 <= full; g += 4) {
      const Out o = out.at(g);
      tile_avx512<QT, 2, 1>(w + g * stride, stride, a, r0, o.y, o.ldy, o.res, o.ldr);
    }
  const int64_t tiles = (rows + 7) / 8;
  for (; g + 2 <= full; g += 2) {
    const Out o = out.at(g);
    for (int64_t i = 0, r = r0; i < tiles; ++i) {
      const int64_t left = rows - (r - r0), count = (left + (tiles - i) - 1) / (tiles - i);
      const uint8_t* panel = w + g * stride;
      switch (count) {
        case 8: tile_avx512<QT, 1, 8>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 7: tile_avx512<QT, 1, 7>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 6: tile_avx512<QT, 1, 6>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 5: tile_avx512<QT, 1, 5>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 4: tile_avx512<QT, 1, 4>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 3: tile_avx512<QT, 1, 3>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        case 2: tile_avx512<QT, 1, 2>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
        default: tile_avx512<QT, 1, 1>(panel, stride, a, r, o.y, o.ldy, o.res, o.ldr); break;
      }
      r += count;
    }
  }
  if (g < g1) groups_simd<QT, kAvx2>(w, stride, n, g, g1, a, r0, r1, out);
}
#endif

bool has_avx2() {
#ifdef BLOCKSPEC_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

bool has_vnni() {
#ifdef BLOCKSPEC_X86
  static const bool ok = has_avx2() && __builtin_cpu_supports("avxvnni");
  return ok;
#else
  return false;
#endif
}

bool has_avx512() {
#ifdef BLOCKSPEC_X86
  static const bool ok = has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

bool available(Variant v) {
  switch (v) {
    case kPortable: return true;
    case kAvx2: return has_avx2();
    case kVnni: return has_vnni();
    case kAvx512: return has_avx512();
    default: return false;
  }
}

}  // namespace

Variant int8_resolve(int64_t requested) {
  if (requested == kAuto) return has_avx512() ? kAvx512 : has_vnni() ? kVnni : has_avx2() ? kAvx2 : kPortable;
  TORCH_CHECK(available(static_cast<Variant>(requested)), "blockspec int8 matmul: variant ", requested,
              " is not available on this CPU (see int8_variants)");
  return static_cast<Variant>(requested);
}

#ifdef BLOCKSPEC_X86
template <Variant V>
void groups_of(int64_t qtype, const uint8_t* w, int64_t stride, int64_t n, int64_t g0, int64_t g1,
               const Activations& a, int64_t r0, int64_t r1, const Out& out) {
  switch (qtype) {
    case kQ4_0: return groups_simd<kQ4_0, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ4_1: return groups_simd<kQ4_1, V>(w, stride, n, g0, g1, a, r0, r1, out);
    case kQ8_0: return groups_simd<kQ8_0, V>(w, stride, n, g0, g1, a, r0, r1, out);
  }
}
#endif

void int8_groups(int64_t qtype, Variant v, const uint8_t* w, int64_t n, int64_t g0, int64_t g1,
                 const Activations& a, int64_t r0, int64_t r1, float* y, int64_t ldy, const float* res,
                 int64_t ldr) {
  const int64_t stride = a.blocks * record_bytes(qtype);
  const Out out{y, ldy, res, ldr};
#ifdef BLOCKSPEC_X86
  if (v == kVnni) return groups_of<kVnni>(qtype, w, stride, n, g0, g1, a, r0, r1, out);
  if (v == kAvx512) {
    switch (qtype) {
      case kQ4_0: return groups_avx512<kQ4_0>(w, stride, n, g0, g1, a, r0, r1, out);
      case kQ4_1: return groups_avx512<kQ4_1>(w, stride, n, g0, g1, a, r0, r1, out);
      case kQ8_0: return groups_avx512<kQ8_0>(w, stride, n, g0, g1, a, r0, r1, out);
    }
  }
  if (v == kAvx2) return groups_of<kAvx2>(qtype, w, stride, n, g0, g1, a, r0, r1, out);
#endif
  for (int64_t g = g0; g < g1; ++g) {
    const Out og = out.at(g);
    group_portable(qtype, w + g * stride, a.blocks, a, r0, r1, og.y, ldy, std::min<int64_t>(kRows, n - g * kRows),
                   og.res, ldr);
  }
}

// ---- ops ------------------------------------------------------------------------------------------------

// GGUF blocks [n, k / 32 * block_bytes] -> the packed layout [ceil(n / 8), k / 32 * record_bytes].
at::Tensor int8_pack(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blockspec int8_pack: blocks must be a contiguous 2-D uint8 tensor");
  const int64_t bytes = stored_block_bytes(qtype), n = blocks.size(0), nb = blocks.size(1) / bytes;
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
  const int64_t rec = record_bytes(qtype), bytes = stored_block_bytes(qtype), nb = packed.size(1) / rec;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  n <= packed.size(0) * kRows,
              "blockspec int8_unpack: packed must be a contiguous uint8 [groups, blocks * record] of >= n rows");
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

// x [M, K] fp32 times the packed weight (n outputs) -> y [M, n] fp32, plus `residual` [M, n] if given.
// `variant`: 0 the best this CPU has, 1 portable, 2 AVX2, 3 AVX-VNNI, 4 AVX512-VNNI (all give the same bits).
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& residual, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "blockspec int8_matmul: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "blockspec int8_matmul: packed must be a contiguous 2-D uint8 tensor");
  const int64_t rows = x.size(0), k = x.size(1), rec = record_bytes(qtype), blocks = k / 32;
  TORCH_CHECK(k % 32 == 0 && packed.size(1) == blocks * rec && n <= packed.size(0) * kRows &&
                  n > (packed.size(0) - 1) * kRows,
              "blockspec int8_matmul: x has ", k, " columns; the packed weight ", packed.sizes(), " holds ",
              packed.size(1) / rec, " blocks per row and ", packed.size(0) * kRows, " rows; n = ", n);
  const Variant v = int8_resolve(variant);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* rp = nullptr;
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.numel() == rows * n,
                "blockspec int8_matmul: residual must hold ", rows, " x ", n, " float32 values");
    rp = res.data_ptr<float>();
  }
  // Reused: a decode step makes ~120 of these. (A reference: a lambda that names a thread_local directly
  // reads each worker's own instance.)
  thread_local Activations reused;
  Activations& a = reused;
  a.resize(rows, k);
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  maybe_parallel(rows, 8 * k, [&](int64_t r0, int64_t r1) {
    quantize_activation_rows(xp + r0 * ldx, ldx, r0, r1, v != kPortable, a);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = packed.size(0), panel = blocks * rec;
  // About 32 KB of weights times rows per task, in whole 4-group tiles.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 15) / std::max<int64_t>(panel * rows, 1) / 4 * 4);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    int8_matmul_part(qtype, v, w, n, g0, g1, a, yp, n, rp, n);
  });
  return y;
}

void int8_matmul_part(int64_t qtype, Variant v, const uint8_t* w, int64_t n, int64_t g0, int64_t g1,
                      const Activations& a, float* y, int64_t ldy, const float* res, int64_t ldr) {
  // Rows in chunks whose activations stay in cache while each of the groups passes over them.
  constexpr int64_t kRowChunk = 64;
  for (int64_t r0 = 0; r0 < a.rows; r0 += kRowChunk)
    int8_groups(qtype, v, w, n, g0, g1, a, r0, std::min(a.rows, r0 + kRowChunk), y, ldy, res, ldr);
}

// The variant auto takes on this CPU, and every variant it has (see int8_matmul).
int64_t int8_variant() { return int8_resolve(kAuto); }
std::vector<int64_t> int8_variants() {
  std::vector<int64_t> out;
  for (int64_t v = kPortable; v <= kAvx512; ++v)
    if (available(static_cast<Variant>(v))) out.push_back(v);
  return out;
}

}  // namespace blockspec_kernels

using namespace blockspec_kernels;

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("int8_pack(Tensor blocks, int qtype) -> Tensor");
  m.def("int8_unpack(Tensor packed, int qtype, int n) -> Tensor");
  m.def("int8_rows(Tensor packed, Tensor ids, int qtype) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor packed, int qtype, int n, Tensor? residual=None, int variant=0) -> Tensor");
  m.def("int8_variant() -> int", [] { return int8_variant(); });
  m.def("int8_variants() -> int[]", [] { return int8_variants(); });
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_unpack", &int8_unpack);
  m.impl("int8_rows", &int8_rows);
  m.impl("int8_matmul", &int8_matmul);
}
