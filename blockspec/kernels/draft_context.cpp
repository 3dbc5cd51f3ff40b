// The DFlash draft's context injection as one op on the CPU (models/draft.py): the target features projected
// and normed, then every draft layer's K and V of them written to its cache.

#include <algorithm>

#include "int8.h"
#include "ops.h"

namespace blockspec_kernels {

// A draft's context (DFlash): target features [b, n, F] projected by fc (blocks, fc_qtype) and normed by
// hidden_norm into ctx [b, n, H], then for every draft layer its K (per-head k_norm, rotary) and V of ctx
// (kv_weights[i]: the k and v rows of its fused qkv blocks, qtypes[i]) written to cache rows starts[b].. of
// slots[b]: the ops the Python layers run, in the same order (same bits), as one op.
void draft_context(const at::Tensor& features, const at::Tensor& fc, int64_t fc_qtype,
                   const at::Tensor& hidden_norm, at::TensorList kv_weights, at::IntArrayRef qtypes,
                   at::TensorList k_norms, double eps, int64_t kv_heads, const at::Tensor& cos,
                   const at::Tensor& sin, at::TensorList cache_k, at::TensorList cache_v,
                   at::IntArrayRef slots, at::IntArrayRef starts, bool int8) {
  const int64_t layers = static_cast<int64_t>(cache_k.size());
  const auto per_layer = [layers](size_t count) { return static_cast<int64_t>(count) == layers; };
  TORCH_CHECK(features.dim() == 3 && layers > 0 && per_layer(kv_weights.size()) && per_layer(qtypes.size()) &&
                  per_layer(k_norms.size()) && per_layer(cache_v.size()),
              "blockspec draft_context: features [b, n, F] and, per layer, a kv weight, type, k norm and "
              "caches");
  const int64_t b = features.size(0), n = features.size(1), rows = b * n;
  const int64_t d = cache_k[0].size(3), max_len = cache_k[0].size(2);
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == b && static_cast<int64_t>(starts.size()) == b &&
                  cos.numel() == rows * d && sin.numel() == rows * d,
              "blockspec draft_context: one slot and start per row; cos/sin [b, n, 1, d]");
  for (int64_t bi = 0; bi < b; ++bi)
    TORCH_CHECK(slots[bi] >= 0 && slots[bi] < cache_k[0].size(0) && starts[bi] >= 0 &&
                    starts[bi] + n <= max_len,
                "blockspec draft_context: row ", bi, " (slot ", slots[bi], ", start ", starts[bi],
                ") is outside the cache");
  const c10::optional<at::Tensor> none;
  auto project = [&](const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t width) {
    return int8 ? int8_matmul(x, w, qtype, width, none, 0) : quant_matmul(x, w, qtype, false, none);
  };
  const int64_t hidden = hidden_norm.numel();
  const at::Tensor ctx = rms_norm(project(features.reshape({rows, -1}).contiguous(), fc, fc_qtype, hidden),
                                  hidden_norm, eps);
  const at::Tensor cs = cos.contiguous(), sn = sin.contiguous();
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(cache_k[i].is_contiguous() && cache_v[i].is_contiguous() && k_norms[i].numel() == d,
                "blockspec draft_context: contiguous caches and a k norm of head_dim values");
    at::Tensor kv = project(ctx, kv_weights[i], qtypes[i], 2 * kv_heads * d);
    float* kvp = kv.data_ptr<float>();
    float* ck = cache_k[i].data_ptr<float>();
    float* cv = cache_v[i].data_ptr<float>();
    const float* kn = k_norms[i].data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t bi = r / n, ni = r % n;
      for (int64_t g = 0; g < kv_heads; ++g) {
        float* k = kvp + r * 2 * kv_heads * d + g * d;
        rms_norm_row(k, kn, static_cast<float>(eps), k, d);
        rope_head(k, cs.data_ptr<float>() + r * d, sn.data_ptr<float>() + r * d, d);
        const int64_t at_row = ((slots[bi] * kv_heads + g) * max_len + starts[bi] + ni) * d;
        std::copy_n(k, d, ck + at_row);
        std::copy_n(k + kv_heads * d, d, cv + at_row);
      }
    }
  }
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("draft_context(Tensor features, Tensor fc, int fc_qtype, Tensor hidden_norm, Tensor[] kv_weights, "
        "int[] qtypes, Tensor[] k_norms, float eps, int kv_heads, Tensor cos, Tensor sin, "
        "Tensor(a!)[] cache_k, Tensor(b!)[] cache_v, int[] slots, int[] starts, bool int8) -> ()");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("draft_context", &blockspec_kernels::draft_context);
}
