// Grouped-query attention's work items, for ops that split them among threads themselves (layer_stack.cpp).
#pragma once

#include <cstdint>

namespace blockspec_kernels {

struct AttentionArgs {
  const float* q;
  const float* k;
  const float* v;
  const bool* visible;  // [b, n, L] or null (all visible)
  const int64_t* slots;  // k / v's first-dim index per batch row, or null (row bi at bi)
  float* out;            // [b, n, heads * d]
  int64_t b, n, heads, kv_heads, length, d;
  int64_t qs[3], ks[3], vs[3];  // strides of q [b, n, heads], k / v [b, kv_heads, L] (last dim contiguous)
  float scale;
};

// The attention's work split into items for `threads` threads (blocks of query rows and heads sharing K/V
// tiles), and items [i0, i1) of that split computed. Every (query, head) gives the same bits in any split.
int64_t attention_items(const AttentionArgs& a, int64_t threads);
void attend_items(const AttentionArgs& a, int64_t i0, int64_t i1, int64_t threads);

}  // namespace blockspec_kernels
