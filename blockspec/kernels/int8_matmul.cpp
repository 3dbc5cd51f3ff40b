// y = x W^T for GGUF block weights (every block type of gguf_blocks.h) with int8 activations: each activation
// row is quantized once per matmul into blocks of 32 int8 values with an fp32 scale (and the block's sum),
// and every 32-weight block dot product runs in integers (AVX2 maddubs/madd, or VNNI dpbusd), exact; only the
// per-block scaling and the sum over blocks are fp32. Weights are repacked once at load: 8 output rows
// interleaved in 4-byte groups, so one 256-bit register holds 4 weights of each of 8 outputs, an activation
// group of 4 bytes is broadcast against it, and each 32-bit lane accumulates one output: 8 outputs per
// register, no horizontal sums. The K-quants' super-blocks become 8 records of 32 (their sub-block scales
// kept as stored).
//
// Exactness and batch invariance: a row's quantization depends on that row alone; a block's integer dot is
// exact whatever the instruction set (Q6_K: each half's dot times its int8 scale, summed); then for each
// output, block by block in order,
//   acc = fma(float(dot_b), d_w,b * d_x,b, acc)      d_w: fp16 d (Q4_K, Q5_K: d * sc, exact in fp32)
//   acc = fma(m_w,b, d_x,b * sum_x,b, acc)            types with a min: m (Q4_1, Q5_1), -(dmin * mn) (K)
// starting from 0. Every variant (portable, AVX2, AVX-VNNI / AVX512-VNNI) computes exactly that sequence, so
// results are bit-identical across variants, row counts, row positions and thread counts.
//
// Packed layout (per group of 8 output rows, block of 32 after block; rows padded to a multiple of 8 with
// zeros; int8_layout.h has each type's record): the scales of the 8 rows side by side, then chunks: chunk c
// holds 4 bytes of each of the 8 rows, row after row. Nibble types (Q4_0, Q4_1, Q4_K): 4 chunks, a byte's
// low nibble weight 4c + j, its high one weight 16 + 4c + j; the others 8 chunks of one byte a weight
// (5- and 6-bit quants widened to a byte; signed ones + 128, as unsigned). Every stored bit is kept
// (int8_unpack gives the file's blocks back).
//
// Files: int8_layout.h and int8_pack.cpp (the layouts), int8_portable.cpp (the portable kernel), int8_ymm.cpp
// and int8_ymm_blocks.h (AVX2, AVX-VNNI), int8_zmm.cpp (AVX512-VNNI);
// here the CPU's variant and the op.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "int8_layout.h"

namespace blockspec_kernels {
using namespace int8_detail;
namespace {

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
  static const bool ok = has_avx2() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
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

void int8_matmul_part(int64_t qtype, Variant v, const uint8_t* w, int64_t n, int64_t g0, int64_t g1,
                      const Activations& a, float* y, int64_t ldy, const float* res, int64_t ldr) {
  const int64_t stride = a.blocks * record_bytes(qtype);
  const Out out{y, ldy, res, ldr};
  // Rows in chunks whose activations stay in cache while each of the groups passes over them.
  constexpr int64_t kRowChunk = 64;
  for (int64_t r0 = 0; r0 < a.rows; r0 += kRowChunk) {
    const int64_t r1 = std::min(a.rows, r0 + kRowChunk);
    if (v == kAvx512)
      groups_zmm(qtype, w, stride, n, g0, g1, a, r0, r1, out);
    else if (v == kPortable)
      groups_portable(qtype, w, stride, n, g0, g1, a, r0, r1, out);
    else
      groups_ymm(qtype, v, w, stride, n, g0, g1, a, r0, r1, out);
  }
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

// The variant auto takes on this CPU, and every variant it has (see int8_matmul).
int64_t int8_variant() { return int8_resolve(kAuto); }
std::vector<int64_t> int8_variants() {
  std::vector<int64_t> out;
  for (int64_t v = kPortable; v <= kAvx512; ++v)
    if (available(static_cast<Variant>(v))) out.push_back(v);
  return out;
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("int8_matmul(Tensor x, Tensor packed, int qtype, int n, Tensor? residual=None, int variant=0) "
        "-> Tensor");
  m.def("int8_variant() -> int", [] { return blockspec_kernels::int8_variant(); });
  m.def("int8_variants() -> int[]", [] { return blockspec_kernels::int8_variants(); });
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) { m.impl("int8_matmul", &blockspec_kernels::int8_matmul); }
