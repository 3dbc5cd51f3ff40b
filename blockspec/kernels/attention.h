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

// Items [i0, i1) of the b * n * heads (batch row, query, head) items, item = (bi * n + qi) * heads + h.
void attend_items(const AttentionArgs& a, int64_t i0, int64_t i1);

}  // namespace blockspec_kernels
