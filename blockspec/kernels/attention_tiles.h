// One (query, head) pair's arithmetic in attention (attention_tiles.cpp): scores over 4 keys, the visible
// keys gathered, the softmax, the V rows accumulated. The portable and AVX2 forms give the same bits.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace blockspec_kernels {

inline constexpr float kHidden = -std::numeric_limits<float>::infinity();  // a hidden key's score

// Scores of queries qa, qb (qa == qb: one query) over keys k[0..4) (rows `stride` apart) into sa, sb[0..4).
void score_tile_portable(const float* qa, const float* qb, const float* k, int64_t stride, int64_t d,
                         float scale, float* sa, float* sb);
#ifdef BLOCKSPEC_X86
AVX2 void score_tile_avx2(const float* qa, const float* qb, const float* k, int64_t stride, int64_t d,
                          float scale, float* sa, float* sb);
AVX2 float softmax_avx2(float* s, int64_t count);
#endif

// Moves the visible scores of keys [0, limit) to the front of s in key order; returns their count.
int64_t gather_visible(const bool* vis, int64_t limit, float* s, std::vector<int64_t>& keys);

// s[0..count) (padded with -inf to a multiple of 8) -> exp(s - max); returns 1 / their sum (0: none).
float softmax_portable(float* s, int64_t count);

// acc[0..d) += p[j] * V row keys[j] (or j) for j in [j0, j1), in key order.
void accumulate(bool fast, float* acc, const float* p, const int64_t* keys, int64_t j0, int64_t j1,
                const float* v, int64_t stride, int64_t d);

}  // namespace blockspec_kernels
