// y = x W^T for GGUF block-quantized weights W held as stored (every type of gguf_blocks.h), with fp32
// activations and fp32 accumulation: the exact reference path. Weights dequantize as gguf-py dequantizes
// them, so the only difference from a dense fp32 matmul over gguf-py's weights is the summation order, which
// is fixed per output: 8 lanes, lane l accumulating elements l, l + 8, l + 16, ... in order by fma, then one
// fixed horizontal sum. It does not depend on how many rows come in or where a row sits (batch invariance),
// nor on the thread count (threads split the outputs, never a sum). The AVX2+FMA+F16C path and the portable
// path compute bit-identical results (Q4_0, Q4_1 and Q8_0 dequantize in vector code, the other types
// through the portable reader, both exact).

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include "gguf_blocks.h"
#include "gguf_dequant_avx2.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BLOCKSPEC_X86 1
#endif

namespace blockspec_kernels {

constexpr int64_t kBlock = 32;  // weights per sub-block: the unit every kernel steps by

// ---- portable path ------------------------------------------------------------------------------------

// The AVX2 path's horizontal sum of 8 lanes, in its order.
inline float lane_sum(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

void rows_portable(int64_t qtype, const uint8_t* wrow, int64_t nblocks, const float* x, int64_t ldx,
                   int64_t rows, float* y, int64_t ldy) {
  float w[32];
  for (int64_t r = 0; r < rows; ++r) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float* xr = x + r * ldx;
    for (int64_t b = 0; b < nblocks; ++b) {
      dequant_row_sub(qtype, wrow, b, w);
      for (int part = 0; part < 4; ++part) {
        for (int lane = 0; lane < 8; ++lane) {
          const int64_t k = part * 8 + lane;
          acc[lane] = std::fma(w[k], xr[b * kBlock + k], acc[lane]);
        }
      }
    }
    y[r * ldy] = lane_sum(acc);
  }
}

// ---- AVX2 path ----------------------------------------------------------------------------------------

#ifdef BLOCKSPEC_X86
using namespace dequant_avx2;
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// Bytes ahead of the block being read that each output's stream prefetches: the weights come from memory
// (a decode step reads each once); a few KB ahead measured best on a 2-core AMD EPYC (the LM head: 4.1 ms
// without, 2.8 ms with, at 2 threads).
constexpr int64_t kPrefetch = 4096;

AVX2 inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// NT consecutive outputs (weight rows `wrow`, `stride` bytes apart) times R activation rows: each of the
// NT * R dot products in its own accumulator, in the one fixed order. Several outputs per pass keep
// independent FMA chains in flight for a single row; several rows per pass dequantize each block once.
template <int64_t QT, int NT, int R>
AVX2 void tile_avx2(const uint8_t* wrow, int64_t stride, int64_t nblocks, const float* x, int64_t ldx,
                    float* y, int64_t ldy) {
  constexpr int64_t elems = QT == kQ4_K || QT == kQ5_K || QT == kQ6_K ? 256 : 32;
  constexpr int64_t bytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : QT == kQ5_0 ? 22 : QT == kQ5_1 ? 24
                            : QT == kQ8_0 ? 34 : QT == kQ4_K ? 144 : QT == kQ5_K ? 176 : QT == kQ6_K ? 210
                            : 64;  // F16, BF16: 32 values
  __m256 acc[NT][R];
#pragma GCC unroll 8
  for (int n = 0; n < NT; ++n)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[n][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = x + b * kBlock;
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) {
      const uint8_t* row = wrow + n * stride;
      _mm_prefetch(reinterpret_cast<const char*>(row + b * 32 / elems * bytes + kPrefetch), _MM_HINT_T0);
      __m256 w[4];
      dequant<QT>(row, b, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = xb + r * ldx;
        __m256 a = acc[n][r];
        a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a);
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
        a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
        acc[n][r] = a;
      }
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum(acc[n][r]);
}

// NT outputs (from weight row `w`) for all `rows` rows: rows in groups of 4, the rest in one smaller group
// (5 left: one group, as a prompt-lookup verify of pending + 4 copied tokens has).
template <int64_t QT, int NT>
AVX2 void rows_avx2(const uint8_t* w, int64_t stride, int64_t nblocks, const float* x, int64_t ldx,
                    int64_t rows, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= rows && rows - r != 5; r += 4)
    tile_avx2<QT, NT, 4>(w, stride, nblocks, x + r * ldx, ldx, y + r * ldy, ldy);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5: return tile_avx2<QT, NT, 5>(w, stride, nblocks, xr, ldx, yr, ldy);
    case 3: return tile_avx2<QT, NT, 3>(w, stride, nblocks, xr, ldx, yr, ldy);
    case 2: return tile_avx2<QT, NT, 2>(w, stride, nblocks, xr, ldx, yr, ldy);
    case 1: return tile_avx2<QT, NT, 1>(w, stride, nblocks, xr, ldx, yr, ldy);
  }
}

// Outputs [n0, n1) for all `rows` rows: 4 outputs at a time for one row (independent FMA chains), 2 for
// more.
template <int64_t QT>
AVX2 void outputs_avx2(const uint8_t* w, int64_t stride, int64_t nblocks, const float* x, int64_t ldx,
                       int64_t rows, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (rows == 1) {
    for (; n + 4 <= n1; n += 4) tile_avx2<QT, 4, 1>(w + n * stride, stride, nblocks, x, ldx, y + n, ldy);
  } else {
    for (; n + 2 <= n1; n += 2) rows_avx2<QT, 2>(w + n * stride, stride, nblocks, x, ldx, rows, y + n, ldy);
  }
  for (; n < n1; ++n) rows_avx2<QT, 1>(w + n * stride, stride, nblocks, x, ldx, rows, y + n, ldy);
}

bool avx2_available() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c");
  return available;
}
#else
bool avx2_available() { return false; }
#endif

void outputs(int64_t qtype, const uint8_t* w, int64_t stride, int64_t nblocks, const float* x, int64_t ldx,
             int64_t rows, float* y, int64_t ldy, int64_t n0, int64_t n1, bool fast) {
#ifdef BLOCKSPEC_X86
  if (fast) {
    switch (qtype) {
      case kQ4_0: return outputs_avx2<kQ4_0>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ4_1: return outputs_avx2<kQ4_1>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ8_0: return outputs_avx2<kQ8_0>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ5_0: return outputs_avx2<kQ5_0>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ5_1: return outputs_avx2<kQ5_1>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ4_K: return outputs_avx2<kQ4_K>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ5_K: return outputs_avx2<kQ5_K>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kQ6_K: return outputs_avx2<kQ6_K>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kF16: return outputs_avx2<kF16>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
      case kBF16: return outputs_avx2<kBF16>(w, stride, nblocks, x, ldx, rows, y, ldy, n0, n1);
    }
  }
#endif
  for (int64_t n = n0; n < n1; ++n) rows_portable(qtype, w + n * stride, nblocks, x, ldx, rows, y + n, ldy);
}

// x [M, K] fp32 (rows contiguous), blocks [N, K / 32 * block_bytes] uint8 -> y [M, N] fp32, plus
// `residual` [M, N] if given (added to each finished dot product, as a separate add would).
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, bool portable,
                        const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "blockspec quant_matmul: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blockspec quant_matmul: blocks must be a contiguous 2-D uint8 tensor");
  const int64_t bytes = block_bytes(qtype), elems = block_elems(qtype);
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % elems == 0 && blocks.size(1) == k / elems * bytes, "blockspec quant_matmul: x has ", k,
              " columns but the weight rows hold ", blocks.size(1), " bytes (", bytes, " per block of ",
              elems, ")");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.numel() == rows * n,
                "blockspec quant_matmul: residual must hold ", rows, " x ", n, " float32 values");
  }
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = blocks.size(1), nblocks = k / kBlock;
  const bool fast = !portable && avx2_available();
  // About 64 KB of weights per task: enough work to beat the pool's overhead, fine enough to balance.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(stride, 1)) / 4 * 4;
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    outputs(qtype, w, stride, nblocks, xp, ldx, rows, yp, n, n0, n1, fast);
    if (rp != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = n0; j < n1; ++j) yp[r * n + j] += rp[r * n + j];
  });
  return y;
}

}  // namespace blockspec_kernels

using namespace blockspec_kernels;

TORCH_LIBRARY(blockspec, m) {
  m.def("quant_matmul(Tensor x, Tensor blocks, int qtype, bool portable=False, Tensor? residual=None) "
        "-> Tensor");
  m.def("avx2_available() -> bool", [] { return avx2_available(); });
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("quant_matmul", &quant_matmul);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
