// Grouped-query attention for CPU fp32 inference, with or without the KV cache: each (row, query, head) on
// its own, its visible keys gathered in key order before the softmax sums them, so a query sees the same
// sums whether hidden keys are absent (a decode step) or present (a verify block; a tree's other branches,
// which sit between a node and its ancestors): batch invariance. For a step's few queries it avoids SDPA's
// flash kernel, which costs ~50 us for one query over a few hundred keys.

#include <limits>
#include <vector>

#include "attention.h"
#include "ops.h"
#include "simd.h"

namespace blockspec_kernels {

float dot_portable(const float* a, const float* b, int64_t d) {
  float dot = 0.0f;
  for (int64_t i = 0; i < d; ++i) dot += a[i] * b[i];
  return dot;
}

#ifdef BLOCKSPEC_X86
// Scores of one query over keys 0..L, padded with -inf to a multiple of 8: four keys at a time, so four
// independent FMA chains are in flight (each key's own sum in one fixed order).
AVX2 void scores_avx2(const AttentionArgs& a, const float* q, const float* k, float* s) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  const int64_t stride = a.ks[2];
  int64_t j = 0;
  for (; j + 4 <= a.length; j += 4) {
    const float* k0 = k + j * stride;
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps();
    __m256 c3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < a.d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      c0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), c0);
      c1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + stride + i), c1);
      c2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * stride + i), c2);
      c3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * stride + i), c3);
    }
    s[j] = hsum8(c0) * a.scale, s[j + 1] = hsum8(c1) * a.scale;
    s[j + 2] = hsum8(c2) * a.scale, s[j + 3] = hsum8(c3) * a.scale;
  }
  for (; j < a.length; ++j) {
    const float* kj = k + j * stride;
    __m256 c = _mm256_setzero_ps();
    for (int64_t i = 0; i < a.d; i += 8)
      c = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), c);
    s[j] = hsum8(c) * a.scale;
  }
  for (j = a.length; j < (a.length + 7) / 8 * 8; ++j) s[j] = kHidden;
}

// softmax-weighted sum of V rows for one query's scores s[0..count) of keys `keys` (null: keys 0..count),
// padded with -inf to a multiple of 8: out[0..d) (d a multiple of 8, at most 256).
AVX2 void attend_avx2(const AttentionArgs& a, const float* v, float* s, const int64_t* keys, int64_t count,
                      float* out) {
  const int64_t padded = (count + 7) / 8 * 8;
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m = hmax8(mx);
  if (m == -std::numeric_limits<float>::infinity()) {  // no visible key: a zero row
    std::fill(out, out + a.d, 0.0f);
    return;
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  const float inv = 1.0f / hsum8(sum);
  __m256 acc[32];
  const int64_t parts = a.d / 8;
  for (int64_t p = 0; p < parts; ++p) acc[p] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    if (s[j] == 0.0f) continue;  // negligible: adds exact zeros
    const __m256 pj = _mm256_set1_ps(s[j]);
    const float* vj = v + (keys != nullptr ? keys[j] : j) * a.vs[2];
    for (int64_t p = 0; p < parts; ++p) acc[p] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * p), acc[p]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t p = 0; p < parts; ++p) _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(acc[p], iv));
}
#endif

// Scores of one query over keys 0..L.
void scores_portable(const AttentionArgs& a, const float* q, const float* k, float* s) {
  for (int64_t j = 0; j < a.length; ++j) s[j] = dot_portable(q, k + j * a.ks[2], a.d) * a.scale;
}

void attend_portable(const AttentionArgs& a, const float* v, float* s, const int64_t* keys, int64_t count,
                     float* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) m = std::max(m, s[j]);
  std::fill(out, out + a.d, 0.0f);
  if (m == -std::numeric_limits<float>::infinity()) return;
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    s[j] = exp1(s[j] - m);
    sum += s[j];
  }
  for (int64_t j = 0; j < count; ++j) {
    if (s[j] == 0.0f) continue;
    const float* vj = v + (keys != nullptr ? keys[j] : j) * a.vs[2];
    for (int64_t i = 0; i < a.d; ++i) out[i] += s[j] * vj[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < a.d; ++i) out[i] *= inv;
}

void check_visible(const c10::optional<at::Tensor>& visible, AttentionArgs& a, at::Tensor& keep) {
  if (!visible.has_value()) return;
  keep = visible->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.dim() == 3 && keep.size(0) == a.b &&
                  keep.size(1) == a.n && keep.size(2) == a.length,
              "blockspec attention: visible must be bool [b, n, L] = [", a.b, ", ", a.n, ", ", a.length,
              "], got ", keep.sizes());
  a.visible = keep.data_ptr<bool>();
}

// Moves the visible keys' scores to the front of s, in key order, with -inf after them up to a multiple of 8,
// and returns their count; `keys` gets their indices, or stays empty where they are keys 0..count (all of
// them, or a causal prefix). A query's sums then run over the same sequence of keys wherever hidden ones sit.
int64_t gather_visible(const bool* vis, int64_t length, float* s, std::vector<int64_t>& keys) {
  keys.clear();
  int64_t count = length;
  if (vis != nullptr) {
    count = 0;
    for (int64_t j = 0; j < length; ++j) {
      if (!vis[j]) continue;
      s[count] = s[j];
      keys.push_back(j);
      ++count;
    }
    if (count == 0 || keys.back() == count - 1) keys.clear();  // a prefix: no indirection needed
  }
  for (int64_t j = count; j < (count + 7) / 8 * 8; ++j) s[j] = -std::numeric_limits<float>::infinity();
  return count;
}

// Items [i0, i1) of the (batch row, query, head) items, each on its own: scores, softmax, weighted V rows.
void attend_items(const AttentionArgs& a, int64_t i0, int64_t i1) {
  const bool fast = avx2_fma() && a.d % 8 == 0 && a.d <= 256;
  const int64_t groups = a.heads / a.kv_heads;
  std::vector<float> scores((a.length + 7) / 8 * 8);
  std::vector<int64_t> keys;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t h = item % a.heads, qi = (item / a.heads) % a.n, bi = item / (a.heads * a.n);
    const int64_t g = h / groups;
    const float* qp = a.q + bi * a.qs[0] + qi * a.qs[1] + h * a.qs[2];
    const int64_t kb = a.slots != nullptr ? a.slots[bi] : bi;
    const float* kp = a.k + kb * a.ks[0] + g * a.ks[1];
    const float* vp = a.v + kb * a.vs[0] + g * a.vs[1];
    const bool* vis_row = a.visible ? a.visible + (bi * a.n + qi) * a.length : nullptr;
    float* op = a.out + (bi * a.n + qi) * a.heads * a.d + h * a.d;
#ifdef BLOCKSPEC_X86
    if (fast) {
      scores_avx2(a, qp, kp, scores.data());
      const int64_t count = gather_visible(vis_row, a.length, scores.data(), keys);
      attend_avx2(a, vp, scores.data(), keys.empty() ? nullptr : keys.data(), count, op);
      continue;
    }
#endif
    scores_portable(a, qp, kp, scores.data());
    const int64_t count = gather_visible(vis_row, a.length, scores.data(), keys);
    attend_portable(a, vp, scores.data(), keys.empty() ? nullptr : keys.data(), count, op);
  }
}

namespace {

at::Tensor attend_all(const at::Tensor& q, AttentionArgs& a) {
  at::Tensor out = at::empty({a.b, a.n, a.heads * a.d}, q.options());
  a.q = q.data_ptr<float>();
  a.out = out.data_ptr<float>();
  for (int i = 0; i < 3; ++i) a.qs[i] = q.stride(i);
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  maybe_parallel(a.b * a.n * a.heads, 4 * a.length * a.d,
                 [&](int64_t i0, int64_t i1) { attend_items(a, i0, i1); });
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
