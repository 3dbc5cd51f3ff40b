// Grouped-query attention for CPU fp32 inference, with or without the KV cache, for a decode step's one query
// as for a prompt chunk's hundreds. Each (query, head) pair is computed by the same arithmetic wherever it
// sits: its score over each key (8 lanes over the head dimension, the lanes reduced in one fixed tree), its
// visible keys gathered in key order before the softmax sums them, their V rows accumulated in key order. So
// a query sees the same sums whether hidden keys are absent (a decode step) or present (a verify block; a
// tree's other branches, between a node and its ancestors; a prompt chunk's later tokens): batch and chunk
// invariance. The work is blocked: the query heads of one KV group and several rows share each K and V tile
// while it is in L1.

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"
#include "ops.h"
#include "simd.h"

namespace blockspec_kernels {
namespace {

constexpr float kHidden = -std::numeric_limits<float>::infinity();
constexpr int64_t kKeyTile = 64;   // keys whose K (or V) rows stay in L1 while the item's queries pass
constexpr int64_t kRowTile = 16;   // query rows per item (with every head of their KV group)

// One query head against one KV group: where its vectors are and what it may see.
struct Query {
  const float* q;
  const bool* visible;  // its row of the mask, or null
  float* out;
  int64_t limit;        // keys [0, limit) may be visible
};

// ---- scores ---------------------------------------------------------------------------------------------

// The lanes of a score reduced as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float reduce_lanes(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

// Scores of queries qa, qb over keys k[0..4) (rows `stride` apart) into sa[0..4), sb[0..4).
void score_tile_portable(const float* qa, const float* qb, const float* k, int64_t stride, int64_t d,
                         float scale, float* sa, float* sb) {
  for (int j = 0; j < 4; ++j) {
    const float* kj = k + j * stride;
    for (int which = 0; which < (qa == qb ? 1 : 2); ++which) {
      const float* q = which == 0 ? qa : qb;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < d; i += 8)
        for (int l = 0; l < 8; ++l) lanes[l] = std::fma(q[i + l], kj[i + l], lanes[l]);
      (which == 0 ? sa : sb)[j] = reduce_lanes(lanes) * scale;
    }
  }
}

#ifdef BLOCKSPEC_X86
// Four keys' reduced lanes at once (hadd pairs the same lanes reduce_lanes pairs): [r(c0), r(c1), r(c2), r(c3)].
AVX2 inline __m128 reduce4(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Scores of query q over keys k[0..4) into s[0..4) (the pair tile's arithmetic for one query).
AVX2 void score_tile1_avx2(const float* q, const float* k, int64_t stride, int64_t d, float scale, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + i), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + i), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + i), a3);
  }
  _mm_storeu_ps(s, _mm_mul_ps(reduce4(a0, a1, a2, a3), _mm_set1_ps(scale)));
}

AVX2 void score_tile_avx2(const float* qa, const float* qb, const float* k, int64_t stride, int64_t d,
                          float scale, float* sa, float* sb) {
  if (qa == qb) return score_tile1_avx2(qa, k, stride, d, scale, sa);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 x = _mm256_loadu_ps(qa + i), y = _mm256_loadu_ps(qb + i);
    const __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + stride + i);
    const __m256 k2 = _mm256_loadu_ps(k + 2 * stride + i), k3 = _mm256_loadu_ps(k + 3 * stride + i);
    a0 = _mm256_fmadd_ps(x, k0, a0), a1 = _mm256_fmadd_ps(x, k1, a1);
    a2 = _mm256_fmadd_ps(x, k2, a2), a3 = _mm256_fmadd_ps(x, k3, a3);
    b0 = _mm256_fmadd_ps(y, k0, b0), b1 = _mm256_fmadd_ps(y, k1, b1);
    b2 = _mm256_fmadd_ps(y, k2, b2), b3 = _mm256_fmadd_ps(y, k3, b3);
  }
  const __m128 sc = _mm_set1_ps(scale);
  _mm_storeu_ps(sa, _mm_mul_ps(reduce4(a0, a1, a2, a3), sc));
  _mm_storeu_ps(sb, _mm_mul_ps(reduce4(b0, b1, b2, b3), sc));
}
#endif

// ---- softmax and V ----------------------------------------------------------------------------------------

// Moves the visible keys' scores (of keys [0, limit)) to the front of s, in key order, with -inf after them
// up to a multiple of 8, and returns their count; `keys` gets their indices, or stays empty where they are
// keys 0..count (all of them, or a causal prefix). A query's sums then run over the same sequence of keys
// wherever hidden ones sit.
int64_t gather_visible(const bool* vis, int64_t limit, float* s, std::vector<int64_t>& keys) {
  keys.clear();
  int64_t count = limit;
  if (vis != nullptr && std::memchr(vis, 0, limit) != nullptr) {  // not a prefix of visible keys
    count = 0;
    for (int64_t j = 0; j < limit; ++j) {
      if (!vis[j]) continue;
      s[count] = s[j];
      keys.push_back(j);
      ++count;
    }
  }
  for (int64_t j = count; j < (count + 7) / 8 * 8; ++j) s[j] = kHidden;
  return count;
}

// s[0..count) (padded with -inf to a multiple of 8) -> exp(s - max) in place; returns 1 / their sum, or 0
// when nothing is visible.
float softmax_portable(float* s, int64_t count) {
  float m = kHidden;
  for (int64_t j = 0; j < count; ++j) m = std::max(m, s[j]);
  if (m == kHidden) return 0.0f;
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    s[j] = exp1(s[j] - m);
    sum += s[j];
  }
  return 1.0f / sum;
}

#ifdef BLOCKSPEC_X86
AVX2 float softmax_avx2(float* s, int64_t count) {
  const int64_t padded = (count + 7) / 8 * 8;
  __m256 mx = _mm256_set1_ps(kHidden);
  for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m = hmax8(mx);
  if (m == kHidden) return 0.0f;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum8(sum);
}

// acc[0..8 P) += p[j] * V row keys[j] (or j) for j in [j0, j1), in order; zero weights add exact zeros,
// skipped. P (d / 8) fixed at compile time keeps the accumulators in registers.
template <int P>
AVX2 void accumulate_avx2(float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                          const float* v, int64_t stride) {
  __m256 a[P];
#pragma GCC unroll 32
  for (int c = 0; c < P; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    if (p[j] == 0.0f) continue;
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + (keys != nullptr ? keys[j] : j) * stride;
#pragma GCC unroll 32
    for (int c = 0; c < P; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), a[c]);
  }
#pragma GCC unroll 32
  for (int c = 0; c < P; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

void accumulate_portable(float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                         const float* v, int64_t stride, int64_t d) {
  for (int64_t j = j0; j < j1; ++j) {
    if (p[j] == 0.0f) continue;
    const float* vj = v + (keys != nullptr ? keys[j] : j) * stride;
    for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p[j], vj[i], acc[i]);
  }
}

void accumulate(bool fast, float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                const float* v, int64_t stride, int64_t d) {
#ifdef BLOCKSPEC_X86
  if (fast) {
    switch (d / 8) {
      case 4: return accumulate_avx2<4>(acc, p, keys, j0, j1, v, stride);
      case 8: return accumulate_avx2<8>(acc, p, keys, j0, j1, v, stride);
      case 16: return accumulate_avx2<16>(acc, p, keys, j0, j1, v, stride);
      case 32: return accumulate_avx2<32>(acc, p, keys, j0, j1, v, stride);
    }
  }
#endif
  accumulate_portable(acc, p, keys, j0, j1, v, stride, d);
}

// Scratch for one thread's items, kept between calls.
struct Scratch {
  std::vector<Query> queries;
  std::vector<float> scores, acc, inv;
  std::vector<int64_t> counts, cursor;
  std::vector<std::vector<int64_t>> keys;
};

// One item: queries `qs` over one KV group's keys k / v (rows `stride` apart), blocked over key tiles.
void attend_queries(const AttentionArgs& a, const float* k, const float* v, Scratch& w) {
  const int64_t nq = static_cast<int64_t>(w.queries.size()), d = a.d, stride = a.ks[2];
  const bool fast = avx2_fma() && d % 8 == 0 && d <= 256;
  int64_t longest = 0;
  for (const Query& q : w.queries) longest = std::max(longest, q.limit);
  const int64_t width = (longest + 7) / 8 * 8 + 8;
  w.scores.resize(nq * width);
  w.acc.assign(nq * d, 0.0f);
  w.inv.resize(nq), w.counts.resize(nq), w.cursor.assign(nq, 0);
  if (static_cast<int64_t>(w.keys.size()) < nq) w.keys.resize(nq);
  // Scores: two queries by four keys at a time, each key tile in L1 while every pair passes over it. A quad
  // that runs past the keys in use is scored from a zero-padded copy of the ones that exist.
  float quad[4 * 256];
  for (int64_t t0 = 0; t0 < longest; t0 += kKeyTile) {
    const int64_t t1 = std::min(longest, t0 + kKeyTile);
    for (int64_t qa = 0; qa < nq; qa += 2) {
      const int64_t qb = std::min(qa + 1, nq - 1);
      const int64_t la = w.queries[qa].limit, lb = w.queries[qb].limit;
      const int64_t end = std::min(t1, std::max(la, lb));
      float* rows[2] = {w.scores.data() + qa * width, w.scores.data() + qb * width};
      int64_t j = t0;
      // Whole quads inside both queries' limits: scores straight into their rows.
      for (; j + 4 <= std::min(end, std::min(la, lb)); j += 4) {
#ifdef BLOCKSPEC_X86
        if (fast)
          score_tile_avx2(w.queries[qa].q, w.queries[qb].q, k + j * stride, stride, d, a.scale, rows[0] + j,
                          rows[1] + j);
        else
#endif
          score_tile_portable(w.queries[qa].q, w.queries[qb].q, k + j * stride, stride, d, a.scale,
                              rows[0] + j, rows[1] + j);
      }
      for (; j < end; j += 4) {
        const float* kj = k + j * stride;
        int64_t kstride = stride;
        if (j + 4 > end) {
          std::fill(quad, quad + 4 * d, 0.0f);
          for (int64_t x = j; x < end; ++x) std::copy_n(k + x * stride, d, quad + (x - j) * d);
          kj = quad, kstride = d;
        }
        float ta[4], tb[4];
#ifdef BLOCKSPEC_X86
        if (fast)
          score_tile_avx2(w.queries[qa].q, w.queries[qb].q, kj, kstride, d, a.scale, ta, tb);
        else
#endif
          score_tile_portable(w.queries[qa].q, w.queries[qb].q, kj, kstride, d, a.scale, ta, tb);
        for (int64_t x = 0; x < 4 && j + x < end; ++x) {
          if (j + x < la) w.scores[qa * width + j + x] = ta[x];
          if (qb != qa && j + x < lb) w.scores[qb * width + j + x] = tb[x];
        }
      }
    }
  }
  // Softmax per query over its visible keys.
  for (int64_t i = 0; i < nq; ++i) {
    const Query& q = w.queries[i];
    float* s = w.scores.data() + i * width;
    w.counts[i] = gather_visible(q.visible, q.limit, s, w.keys[i]);
#ifdef BLOCKSPEC_X86
    if (fast) {
      w.inv[i] = softmax_avx2(s, w.counts[i]);
      continue;
    }
#endif
    w.inv[i] = softmax_portable(s, w.counts[i]);
  }
  // V: key tile by key tile, each query's visible keys in order.
  for (int64_t t0 = 0; t0 < longest; t0 += kKeyTile) {
    const int64_t t1 = t0 + kKeyTile;
    for (int64_t i = 0; i < nq; ++i) {
      const std::vector<int64_t>& keys = w.keys[i];
      const int64_t* index = keys.empty() ? nullptr : keys.data();
      int64_t j1 = std::min(w.counts[i], t1);  // a prefix: keys t0.. are positions t0..
      if (index != nullptr) {
        j1 = w.cursor[i];
        while (j1 < w.counts[i] && index[j1] < t1) ++j1;
      }
      if (j1 == w.cursor[i]) continue;
      accumulate(fast, w.acc.data() + i * d, w.scores.data() + i * width, index, w.cursor[i], j1, v, a.vs[2], d);
      w.cursor[i] = j1;
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float* acc = w.acc.data() + i * d;
    for (int64_t x = 0; x < d; ++x) w.queries[i].out[x] = acc[x] * w.inv[i];
  }
}

// How the b * n * heads (query, head) pairs split into items: each item one batch row's query rows
// [r0, r0 + kRowTile) with the heads of one KV group, or with one head where too few items would leave
// threads idle (a decode step: b rows of one query).
struct Items {
  int64_t row_tiles, heads_per_item, per_group, count;
};

Items item_plan(const AttentionArgs& a, int64_t threads) {
  Items it{};
  it.row_tiles = (a.n + kRowTile - 1) / kRowTile;
  const int64_t groups = a.heads / a.kv_heads;
  it.heads_per_item = a.b * a.kv_heads * it.row_tiles >= 4 * threads ? groups : 1;
  it.per_group = groups / it.heads_per_item;
  it.count = a.b * a.kv_heads * it.row_tiles * it.per_group;
  return it;
}

}  // namespace

int64_t attention_items(const AttentionArgs& a, int64_t threads) { return item_plan(a, threads).count; }

void attend_items(const AttentionArgs& a, int64_t i0, int64_t i1, int64_t threads) {
  const Items plan = item_plan(a, threads);
  thread_local Scratch scratch;
  Scratch& w = scratch;
  const int64_t groups = a.heads / a.kv_heads;
  for (int64_t item = i0; item < i1; ++item) {
    int64_t rest = item;
    const int64_t part = rest % plan.per_group;
    rest /= plan.per_group;
    const int64_t tile = rest % plan.row_tiles;
    rest /= plan.row_tiles;
    const int64_t g = rest % a.kv_heads, bi = rest / a.kv_heads;
    const int64_t kb = a.slots != nullptr ? a.slots[bi] : bi;
    const float* k = a.k + kb * a.ks[0] + g * a.ks[1];
    const float* v = a.v + kb * a.vs[0] + g * a.vs[1];
    w.queries.clear();
    for (int64_t qi = tile * kRowTile; qi < std::min(a.n, (tile + 1) * kRowTile); ++qi) {
      const bool* vis = a.visible ? a.visible + (bi * a.n + qi) * a.length : nullptr;
      int64_t limit = a.length;
      if (vis != nullptr)
        while (limit > 0 && !vis[limit - 1]) --limit;
      for (int64_t h = g * groups + part * plan.heads_per_item; h < g * groups + (part + 1) * plan.heads_per_item;
           ++h)
        w.queries.push_back({a.q + bi * a.qs[0] + qi * a.qs[1] + h * a.qs[2], vis,
                             a.out + (bi * a.n + qi) * a.heads * a.d + h * a.d, limit});
    }
    attend_queries(a, k, v, w);
  }
}

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
