// Fused CPU fp32 inference ops for the layers' small steps: RMSNorm, the rotary embedding, the SiLU gate and
// attention. On a decode step each replaces several torch ops whose dispatch costs more than their math
// (a one-row step runs ~15 of them per layer), and attention avoids SDPA's flash kernel, which costs ~50 us
// for one query over a few hundred keys.
//
// Every result row depends on its own inputs only, in a fixed order: a token's values do not depend on how
// many rows came with it (batch invariance). Attention sums over all keys in key order, hidden keys
// contributing exact zeros, so a query sees the same sums whether the keys past it are absent (a decode
// step) or present and hidden (a verify block).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BLOCKSPEC_X86 1
#endif

namespace blockspec_kernels {

constexpr float kMinExpArg = -87.3f;  // exp below this is < 1.2e-38: taken as 0 (and -inf gives 0)

#ifdef BLOCKSPEC_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

AVX2 inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// exp of 8 lanes (Cephes' polynomial after a base-2 range reduction; ~1 ulp), 0 below kMinExpArg.
AVX2 inline __m256 exp8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kMinExpArg), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kMinExpArg)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
  const __m256i pow2 = _mm256_slli_epi32(exponent, 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2)), keep);
}

bool avx2_fma() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
}
#else
bool avx2_fma() { return false; }
#endif

inline float exp1(float x) { return x < kMinExpArg ? 0.0f : std::exp(x); }

void check_cpu_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "blockspec ", op, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() > 0 && t.stride(-1) == 1, "blockspec ", op, ": ", name,
              "'s last dim must be contiguous");
}

// Runs fn(i0, i1) over [0, n) on torch's pool when the work (flops) pays for waking it, else inline.
template <typename F>
void maybe_parallel(int64_t n, int64_t flops_per_item, const F& fn) {
  constexpr int64_t kParallelFlops = 1 << 20;
  if (n * flops_per_item < kParallelFlops || at::get_num_threads() == 1) return fn(0, n);
  const int64_t grain = std::max<int64_t>(1, (kParallelFlops / 4) / std::max<int64_t>(flops_per_item, 1));
  at::parallel_for(0, n, grain, fn);
}

// ---- RMSNorm --------------------------------------------------------------------------------------------

// y = (x * rsqrt(mean(x^2) + eps)) * weight, per row of x [..., H].
at::Tensor rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight, double eps) {
  check_cpu_float(x_in, "rms_norm", "x");
  const at::Tensor x = x_in.contiguous();
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  at::Tensor y = at::empty_like(x);
  const float* w = nullptr;
  at::Tensor wc;
  if (weight.has_value()) {
    wc = weight->contiguous();
    TORCH_CHECK(wc.scalar_type() == at::kFloat && wc.numel() == h, "blockspec rms_norm: weight must be ",
                h, " float32 values");
    w = wc.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  maybe_parallel(rows, 4 * h, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * h;
      float* yr = yp + r * h;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < h; ++i) lanes[i % 8] += xr[i] * xr[i];
      const float ss = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                       ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
      const float scale = 1.0f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) yr[i] = w ? (xr[i] * scale) * w[i] : xr[i] * scale;
    }
  });
  return y;
}

// ---- rotary embedding ---------------------------------------------------------------------------------

// Neox rotation, in place, of x [b, n, heads, d] (any strides but the last) by cos / signed sin [b, n, 1, d]
// (see blockspec/layers/rotary.py): x[i] <- x[i] cos[i] + x[(i + d/2) mod d] sin[i].
void rope_(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_cpu_float(x, "rope_", "x");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.size(3) <= 1024,
              "blockspec rope_: x must be [b, n, heads, d], d even");
  const int64_t b = x.size(0), n = x.size(1), heads = x.size(2), d = x.size(3), half = d / 2;
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  TORCH_CHECK(cs.numel() == b * n * d && sn.numel() == b * n * d, "blockspec rope_: cos/sin must hold ",
              b * n * d, " values ([b, n, 1, d])");
  float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float tmp[1024];
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ni = 0; ni < n; ++ni) {
      const float* c = cp + (bi * n + ni) * d;
      const float* s = sp + (bi * n + ni) * d;
      for (int64_t hi = 0; hi < heads; ++hi) {
        float* xr = xp + bi * x.stride(0) + ni * x.stride(1) + hi * x.stride(2);
        std::copy(xr, xr + d, tmp);
        for (int64_t i = 0; i < half; ++i) xr[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) xr[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
      }
    }
  }
}

// ---- SiLU gate ------------------------------------------------------------------------------------------

#ifdef BLOCKSPEC_X86
AVX2 void silu_mul_avx2(const float* g, const float* u, float* y, int64_t width) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < width; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
}
#endif

// silu(gate) * up for gate_up [..., 2I] (gate first, as a fused gate/up projection writes it) -> [..., I].
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  check_cpu_float(gate_up_in, "silu_mul", "gate_up");
  const at::Tensor gu = gate_up_in.contiguous();
  const int64_t width = gu.size(-1) / 2, rows = gu.numel() / std::max<int64_t>(gu.size(-1), 1);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = width;
  at::Tensor y = at::empty(shape, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool fast = avx2_fma() && width % 8 == 0;
  maybe_parallel(rows, 20 * width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * width;
      float* yr = yp + r * width;
#ifdef BLOCKSPEC_X86
      if (fast) {
        silu_mul_avx2(g, g + width, yr, width);
        continue;
      }
#endif
      for (int64_t i = 0; i < width; ++i) yr[i] = g[i] / (1.0f + exp1(-g[i])) * g[width + i];
    }
  });
  return y;
}

// ---- attention ------------------------------------------------------------------------------------------

struct AttentionArgs {
  const float* q;
  const float* k;
  const float* v;
  const bool* visible;  // [b, n, L] or null (all visible)
  const int64_t* slots;  // k / v's first-dim index per batch row, or null (row bi at bi)
  float* out;
  int64_t b, n, heads, kv_heads, length, d;
  int64_t qs[3], ks[3], vs[3];  // strides of q [b, n, heads], k / v [b, kv_heads, L] (last dim contiguous)
  float scale;
};

float dot_portable(const float* a, const float* b, int64_t d) {
  float dot = 0.0f;
  for (int64_t i = 0; i < d; ++i) dot += a[i] * b[i];
  return dot;
}

#ifdef BLOCKSPEC_X86
// Scores of one query over keys 0..L (hidden keys -inf), padded with -inf to a multiple of 8: four keys at a
// time, so four independent FMA chains are in flight (each key's own sum in one fixed order).
AVX2 void scores_avx2(const AttentionArgs& a, const float* q, const float* k, const bool* vis, float* s) {
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
  if (vis != nullptr)
    for (j = 0; j < a.length; ++j) s[j] = vis[j] ? s[j] : kHidden;
  for (j = a.length; j < (a.length + 7) / 8 * 8; ++j) s[j] = kHidden;
}

// softmax-weighted sum of V rows for one query's scores: out[0..d) (d a multiple of 8, at most 256).
AVX2 void attend_avx2(const AttentionArgs& a, const float* v, float* s, float* out) {
  const int64_t padded = (a.length + 7) / 8 * 8;
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
  for (int64_t j = 0; j < a.length; ++j) {
    if (s[j] == 0.0f) continue;  // hidden or negligible: adds exact zeros
    const __m256 pj = _mm256_set1_ps(s[j]);
    const float* vj = v + j * a.vs[2];
    for (int64_t p = 0; p < parts; ++p) acc[p] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * p), acc[p]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t p = 0; p < parts; ++p) _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(acc[p], iv));
}
#endif

// Scores of one query over keys 0..L (hidden keys -inf).
void scores_portable(const AttentionArgs& a, const float* q, const float* k, const bool* vis, float* s) {
  for (int64_t j = 0; j < a.length; ++j)
    s[j] = vis == nullptr || vis[j] ? dot_portable(q, k + j * a.ks[2], a.d) * a.scale
                                    : -std::numeric_limits<float>::infinity();
}

void attend_portable(const AttentionArgs& a, const float* v, float* s, float* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < a.length; ++j) m = std::max(m, s[j]);
  std::fill(out, out + a.d, 0.0f);
  if (m == -std::numeric_limits<float>::infinity()) return;
  float sum = 0.0f;
  for (int64_t j = 0; j < a.length; ++j) {
    s[j] = exp1(s[j] - m);
    sum += s[j];
  }
  for (int64_t j = 0; j < a.length; ++j) {
    if (s[j] == 0.0f) continue;
    const float* vj = v + j * a.vs[2];
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

// Each (batch row, query, head) on its own: scores, softmax, weighted V rows.
at::Tensor attend_all(const at::Tensor& q, AttentionArgs& a) {
  at::Tensor out = at::empty({a.b, a.n, a.heads * a.d}, q.options());
  a.q = q.data_ptr<float>();
  a.out = out.data_ptr<float>();
  for (int i = 0; i < 3; ++i) a.qs[i] = q.stride(i);
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  const bool fast = avx2_fma() && a.d % 8 == 0 && a.d <= 256;
  const int64_t groups = a.heads / a.kv_heads, items = a.b * a.n * a.heads;
  maybe_parallel(items, 4 * a.length * a.d, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores((a.length + 7) / 8 * 8);
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
        scores_avx2(a, qp, kp, vis_row, scores.data());
        attend_avx2(a, vp, scores.data(), op);
        continue;
      }
#endif
      scores_portable(a, qp, kp, vis_row, scores.data());
      attend_portable(a, vp, scores.data(), op);
    }
  });
  return out;
}

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
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? visible) -> Tensor");
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, int[] slots, "
        "int[] starts, int length, Tensor? visible) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("attention", &attention);
  m.impl("cache_attention", &cache_attention);
}
