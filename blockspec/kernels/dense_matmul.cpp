// y = x W^T (+ bias) (+ residual) for a dense fp32 CPU weight W [N, K], held row-major (a tied head: the
// embedding) or column-major (a Linear's own weight), every output's sum in one fixed order: a row gets the
// same bits alone or inside any number of rows, in any chunk, at any thread count, under any instruction
// set, from either layout. (A BLAS picks its GEMM form and blocking by the row count, and its sums follow:
// a request batched beside others would see other bits than alone.)
//
// The order: the K inputs form a tree of halves kLevels deep (a range of n inputs is its first n - n/2, then
// the rest), each of its 2^kLevels leaves one fused chain acc = fma(x_k, w_k, acc) from +0 in input order,
// each node the sum left + right; then + bias, then + residual. A row-parallel rank of tp = 2^t ranks
// holding its K / tp inputs computes its subtree (`levels` = kLevels - t), so the ranks' parts summed as a
// tree of halves are one rank's root (then the bias is added): up to 2^kLevels ranks give one rank's bits.
//
// The work: threads split the outputs (never a sum); each takes its outputs in slabs (a leaf's partial sums
// of every row held in L1 while the slab's weights stream past, dense_leaf.cpp), the leaves' results on a
// stack of slots in post-order (a node adds its right child into its left).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "dense.h"
#include "simd.h"

namespace blockspec_kernels {
using namespace dense;
namespace {

constexpr int64_t kLevels = 3;          // the tree's depth: 8 leaves
constexpr int64_t kRowChunk = 64;       // rows whose partial sums are held at once
constexpr int64_t kPanel = 32;          // outputs: threads split them in runs of whole panels
constexpr int64_t kStrip = 64;          // outputs: a slab's width is a multiple of this (the tiles' width)
constexpr int64_t kSumsFloats = 4096;   // a slot of partial sums, at most (16 KB: in L1)
constexpr int64_t kPackFloats = 32768;  // a row-major weight's transposed slab, at most (128 KB)

struct Leaf {
  int64_t start, length;
};

void plan_leaves(int64_t start, int64_t n, int64_t levels, std::vector<Leaf>& out) {
  if (levels == 0) {
    out.push_back({start, n});
    return;
  }
  const int64_t left = n - n / 2;
  plan_leaves(start, left, levels - 1, out);
  plan_leaves(start + left, n - left, levels - 1, out);
}

// The weight as the kernel reads it: column-major (element (n, k) at w[k * ld + n]) or row-major
// (at w[n * ld + k]).
struct Weight {
  const float* w;
  int64_t ld;
  bool k_major;
};

struct Rows {
  const float* x;      // rows ldx apart
  int64_t ldx, count;
  const float* bias;   // [N] or null
  const float* res;    // rows ldr apart, or null
  int64_t ldr;
  float* y;            // rows ldy apart
  int64_t ldy;
};

// Outputs [n0, n0 + width) of every row. `sums`: (levels + 1) slots of rows x room floats; `pack`: room
// x the longest leaf floats (a row-major weight's slab, transposed).
void slab(Variant v, const Rows& rows, const Weight& wt, int64_t n0, int64_t width, int64_t room,
          const std::vector<Leaf>& leaves, float* sums, float* pack) {
  const int64_t slot = rows.count * room;
  int64_t top = 0;
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Leaf& leaf = leaves[i];
    Slab s{wt.w + leaf.start * wt.ld + n0, wt.ld, width};
    if (!wt.k_major) {
      pack_transposed(v, wt.w + n0 * wt.ld + leaf.start, wt.ld, width, leaf.length, pack, room);
      s = {pack, room, width};
    }
    leaf_rows(v, rows.x + leaf.start, rows.ldx, rows.count, s, leaf.length, sums + top * slot, room);
    ++top;
    for (size_t done = i; done & 1; done >>= 1, --top)  // the nodes leaf i completes: its trailing 1 bits
      for (int64_t r = 0; r < rows.count; ++r)
        add_into(v, sums + (top - 2) * slot + r * room, sums + (top - 1) * slot + r * room, width);
  }
  for (int64_t r = 0; r < rows.count; ++r) {
    const float* sum = sums + r * room;
    float* y = rows.y + r * rows.ldy + n0;
    for (int64_t j = 0; j < width; ++j) {
      float out = sum[j];
      if (rows.bias != nullptr) out = out + rows.bias[n0 + j];
      if (rows.res != nullptr) out = out + rows.res[r * rows.ldr + n0 + j];
      y[j] = out;
    }
  }
}

bool available(Variant v) {
  switch (v) {
    case kPortable: return true;
    case kAvx2: return avx2_fma();
#ifdef BLOCKSPEC_X86
    case kAvx512: {
      static const bool ok = avx2_fma() && __builtin_cpu_supports("avx512f");
      return ok;
    }
#endif
    default: return false;
  }
}

Variant resolve(int64_t requested) {
  if (requested == kAuto) return available(kAvx512) ? kAvx512 : available(kAvx2) ? kAvx2 : kPortable;
  TORCH_CHECK(available(static_cast<Variant>(requested)), "blockspec dense_matmul: variant ", requested,
              " is not available on this CPU (see dense_variants)");
  return static_cast<Variant>(requested);
}

}  // namespace

// x [M, K] times weight [N, K] (either layout; other strides are copied first) -> y [M, N], plus bias [N]
// and residual [M, N] when given. `variant`: 0 the widest this CPU has, 1 portable, 2 AVX2, 3 AVX-512.
// `levels`: the tree's depth (kLevels; a row-parallel rank of 2^t ranks: kLevels - t).
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, int64_t variant, int64_t levels) {
  check_cpu_float(x, "dense_matmul", "x");
  TORCH_CHECK(x.dim() == 2, "blockspec dense_matmul: x must be 2-D, got ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && weight.scalar_type() == at::kFloat,
              "blockspec dense_matmul: weight must be a 2-D float32 CPU tensor");
  TORCH_CHECK(levels >= 0 && levels <= kLevels, "blockspec dense_matmul: levels=", levels, " must be in [0, ",
              kLevels, "]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "blockspec dense_matmul: x has ", k, " columns, weight ", weight.sizes());
  const Variant v = resolve(variant);
  at::Tensor w = weight;
  const bool k_major = w.stride(0) == 1 && n > 1;
  if (!k_major && w.stride(1) != 1 && k > 1) w = w.contiguous();
  const Weight wt{w.data_ptr<float>(), k_major ? w.stride(1) : w.stride(0), k_major};
  at::Tensor b, res;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "blockspec dense_matmul: bias must hold ",
                n, " float32 values");
  }
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.numel() == m * n,
                "blockspec dense_matmul: residual must hold ", m, " x ", n, " float32 values");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  std::vector<Leaf> leaves;
  plan_leaves(0, k, levels, leaves);
  const int64_t longest = std::max<int64_t>(1, leaves.front().length);
  const Rows all{x.data_ptr<float>(), x.stride(0), m, b.defined() ? b.data_ptr<float>() : nullptr,
                 res.defined() ? res.data_ptr<float>() : nullptr, n, y.data_ptr<float>(), n};
  // Threads take equal runs of whole panels; a product too small to pay for waking them runs here.
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const bool inline_ = n * k * (m + 4) < (int64_t{1} << 17) || at::get_num_threads() == 1;
  const int64_t parts = inline_ ? 1 : std::min<int64_t>(panels, at::get_num_threads());
  auto work = [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> sums, pack;
    for (int64_t part = p0; part < p1; ++part) {
      const int64_t lo = panels * part / parts * kPanel;
      const int64_t hi = std::min(n, panels * (part + 1) / parts * kPanel);
      for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
        Rows rows = all;
        rows.count = std::min(kRowChunk, m - r0);
        rows.x += r0 * rows.ldx;
        rows.y += r0 * rows.ldy;
        if (rows.res != nullptr) rows.res += r0 * rows.ldr;
        // Slabs as wide as a slot of every row's partial sums fits L1 (and a transposed slab, L2).
        int64_t room = std::max<int64_t>(kPanel, kSumsFloats / rows.count / kStrip * kStrip);
        if (!k_major)
          room = std::min(room, std::max<int64_t>(kPanel, kPackFloats / longest / kPanel * kPanel));
        room = std::min(room, (hi - lo + 15) / 16 * 16);
        sums.resize((levels + 1) * rows.count * room);
        if (!k_major) pack.resize(longest * room);
        for (int64_t n0 = lo; n0 < hi; n0 += room)
          slab(v, rows, wt, n0, std::min(room, hi - n0), room, leaves, sums.data(), pack.data());
      }
    }
  };
  if (parts == 1)
    work(0, 1);
  else
    at::parallel_for(0, parts, 1, work);
  return y;
}

std::vector<int64_t> dense_variants() {
  std::vector<int64_t> out;
  for (int64_t v = kPortable; v <= kAvx512; ++v)
    if (available(static_cast<Variant>(v))) out.push_back(v);
  return out;
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("dense_matmul(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, int variant=0, "
        "int levels=3) -> Tensor");
  m.def("dense_variants() -> int[]", [] { return blockspec_kernels::dense_variants(); });
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) { m.impl("dense_matmul", &blockspec_kernels::dense_matmul); }
