// The attention ops: `attention` (q over given k / v) and `cache_attention` (the new tokens' K/V written to
// the cache, then q over each row's cache), checked and split among torch's threads (attention.cpp).

#include <algorithm>
#include <cmath>

#include "attention.h"
#include "ops.h"
#include "simd.h"

namespace blockspec_kernels {
namespace {

void check_visible(const c10::optional<at::Tensor>& visible, AttentionArgs& a, at::Tensor& keep) {
  if (!visible.has_value()) return;
  keep = visible->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.dim() == 3 && keep.size(0) == a.b &&
                  keep.size(1) == a.n && keep.size(2) == a.length,
              "blockspec attention: visible must be bool [b, n, L] = [", a.b, ", ", a.n, ", ", a.length,
              "], got ", keep.sizes());
  a.visible = keep.data_ptr<bool>();
}

at::Tensor attend_all(const at::Tensor& q, AttentionArgs& a) {
  at::Tensor out = at::empty({a.b, a.n, a.heads * a.d}, q.options());
  a.q = q.data_ptr<float>();
  a.out = out.data_ptr<float>();
  for (int i = 0; i < 3; ++i) a.qs[i] = q.stride(i);
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  const int64_t threads = at::get_num_threads(), items = attention_items(a, threads);
  maybe_parallel(items, 4 * a.length * a.d * a.b * a.n * a.heads / std::max<int64_t>(items, 1),
                 [&](int64_t i0, int64_t i1) { attend_items(a, i0, i1, threads); });
  return out;
}

}  // namespace

// Grouped-query attention: q [b, n, heads, d], k / v [b, kv_heads, L, d], visible bool [b, n, L] or None
// (every query sees every key). Returns [b, n, heads * d]. Scale 1/sqrt(d), as SDPA's default.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& visible) {
  check_cpu_float(q, "attention", "q");
  check_cpu_float(k, "attention", "k");
  check_cpu_float(v, "attention", "v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "blockspec attention: q must be [b, n, heads, d] and k, v [b, kv_heads, L, d]");
  AttentionArgs a{};
  a.b = q.size(0), a.n = q.size(1), a.heads = q.size(2), a.d = q.size(3);
  a.kv_heads = k.size(1), a.length = k.size(2);
  TORCH_CHECK(a.d % 8 == 0 && a.d <= 256, "blockspec attention: head_dim ", a.d,
              " is not supported (a multiple of 8, at most 256)");
  TORCH_CHECK(k.size(0) == a.b && k.size(3) == a.d && a.kv_heads > 0 && a.heads % a.kv_heads == 0,
              "blockspec attention: k/v ", k.sizes(), " do not fit q ", q.sizes());
  at::Tensor keep;
  check_visible(visible, a, keep);
  a.k = k.data_ptr<float>(), a.v = v.data_ptr<float>();
  for (int i = 0; i < 3; ++i) a.ks[i] = k.stride(i), a.vs[i] = v.stride(i);
  return attend_all(q, a);
}

// The new tokens' K/V (k, v [b, n, kv_heads, d]) written to cache rows starts[i].. of slots[i] (caches
// [slots, kv_heads, max_len, d], contiguous), then attention of q [b, n, heads, d] over each row's cache
// rows 0..length: one op for a cached forward's whole attention.
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cache_k, const at::Tensor& cache_v, at::IntArrayRef slots,
                           at::IntArrayRef starts, int64_t length, const c10::optional<at::Tensor>& visible) {
  check_cpu_float(q, "cache_attention", "q");
  check_cpu_float(k, "cache_attention", "k");
  check_cpu_float(v, "cache_attention", "v");
  check_cpu_float(cache_k, "cache_attention", "cache_k");
  TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous() && cache_k.sizes() == cache_v.sizes() &&
                  cache_k.dim() == 4 && cache_v.scalar_type() == at::kFloat,
              "blockspec cache_attention: caches must be contiguous float32 [slots, kv_heads, max_len, d]");
  AttentionArgs a{};
  a.b = q.size(0), a.n = q.size(1), a.heads = q.size(2), a.d = q.size(3);
  a.kv_heads = cache_k.size(1), a.length = length;
  const int64_t max_len = cache_k.size(2);
  TORCH_CHECK(a.d % 8 == 0 && a.d <= 256, "blockspec cache_attention: head_dim ", a.d,
              " is not supported (a multiple of 8, at most 256)");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == a.b && k.size(1) == a.n &&
                  k.size(2) == a.kv_heads && k.size(3) == a.d && cache_k.size(3) == a.d &&
                  a.heads % a.kv_heads == 0,
              "blockspec cache_attention: k/v ", k.sizes(), " and cache ", cache_k.sizes(), " do not fit q ",
              q.sizes());
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == a.b && static_cast<int64_t>(starts.size()) == a.b,
              "blockspec cache_attention: one slot and start per batch row");
  TORCH_CHECK(length <= max_len, "blockspec cache_attention: length ", length, " > cache rows ", max_len);
  float* ck = cache_k.data_ptr<float>();
  float* cv = cache_v.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t bi = 0; bi < a.b; ++bi) {
    TORCH_CHECK(slots[bi] >= 0 && slots[bi] < cache_k.size(0) && starts[bi] >= 0 &&
                    starts[bi] + a.n <= max_len,
                "blockspec cache_attention: row ", bi, " (slot ", slots[bi], ", start ", starts[bi],
                ") is outside the cache");
    for (int64_t ni = 0; ni < a.n; ++ni) {
      for (int64_t h = 0; h < a.kv_heads; ++h) {
        const int64_t row = ((slots[bi] * a.kv_heads + h) * max_len + starts[bi] + ni) * a.d;
        std::copy_n(kp + bi * k.stride(0) + ni * k.stride(1) + h * k.stride(2), a.d, ck + row);
        std::copy_n(vp + bi * v.stride(0) + ni * v.stride(1) + h * v.stride(2), a.d, cv + row);
      }
    }
  }
  at::Tensor keep;
  check_visible(visible, a, keep);
  a.k = ck, a.v = cv, a.slots = slots.data();
  a.ks[0] = a.vs[0] = a.kv_heads * max_len * a.d;
  a.ks[1] = a.vs[1] = max_len * a.d;
  a.ks[2] = a.vs[2] = a.d;
  return attend_all(q, a);
}
}  // namespace blockspec_kernels

using namespace blockspec_kernels;

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? visible) -> Tensor");
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, int[] slots, "
        "int[] starts, int length, Tensor? visible) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("attention", &attention);
  m.impl("cache_attention", &cache_attention);
}

