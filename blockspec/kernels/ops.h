// The extension's ops as C++ functions, for ops built from others (layer_stack.cpp).
#pragma once

#include <torch/extension.h>

namespace blockspec_kernels {

// Bytes of one stored GGUF block of a GGML type (gguf_blocks.cpp); refuses other types.
int64_t block_bytes(int64_t qtype);

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, bool portable,
                        const c10::optional<at::Tensor>& residual);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& residual, int64_t variant);
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps);
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cache_k, const at::Tensor& cache_v, at::IntArrayRef slots,
                           at::IntArrayRef starts, int64_t length, const c10::optional<at::Tensor>& visible);

// One row's worth of the ops above, for ops that split rows among threads themselves (the same arithmetic).
void rms_norm_row(const float* x, const float* w, float eps, float* y, int64_t h);
void rope_head(float* x, const float* cos, const float* sin, int64_t d);
void silu_mul_row(const float* gate_up, float* y, int64_t width);

}  // namespace blockspec_kernels
