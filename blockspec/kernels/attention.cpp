// Grouped-query attention for CPU fp32 inference, with or without the KV cache, for a decode step's one
// query as for a prompt chunk's hundreds. Each (query, head) pair is computed by the same arithmetic
// wherever it sits (attention_tiles.cpp): its score over each key, its visible keys gathered in key order
// before the softmax sums them, their V rows accumulated in key order. So a query sees the same sums
// whether hidden keys are absent (a decode step) or present (a verify block; a tree's other branches,
// between a node and its ancestors; a prompt chunk's later tokens): batch and chunk invariance. The work is
// blocked: the query heads of one KV group and several rows share each K and V tile while it is in L1.

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"
#include "attention_tiles.h"
#include "ops.h"
#include "simd.h"

namespace blockspec_kernels {
namespace {

constexpr int64_t kKeyTile = 64;   // keys whose K (or V) rows stay in L1 while the item's queries pass
constexpr int64_t kRowTile = 16;   // query rows per item (with every head of their KV group)

// One query head against one KV group: where its vectors are and what it may see.
struct Query {
  const float* q;
  const bool* visible;  // its row of the mask, or null
  float* out;
  int64_t limit;        // keys [0, limit) may be visible
};


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
      accumulate(fast, w.acc.data() + i * d, w.scores.data() + i * width, index, w.cursor[i], j1, v,
                 a.vs[2], d);
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
      const int64_t h0 = g * groups + part * plan.heads_per_item;
      for (int64_t h = h0; h < h0 + plan.heads_per_item; ++h)
        w.queries.push_back({a.q + bi * a.qs[0] + qi * a.qs[1] + h * a.qs[2], vis,
                             a.out + (bi * a.n + qi) * a.heads * a.d + h * a.d, limit});
    }
    attend_queries(a, k, v, w);
  }
}

}  // namespace blockspec_kernels
