// A stack of Llama decoder layers whose linears are held as GGUF blocks, run as one op on the CPU: the ops
// the Python layers call (blockspec/models/target.py, DecoderLayer) in the same order on the same values,
// without a trip through Python between them (on a one-token step, that trip costs more than the
// attention). Per layer: RMSNorm, the fused qkv projection, rotary on q and k in place, the KV-cache write
// and attention, the o projection plus the residual, RMSNorm, the fused gate/up projection, the SiLU gate,
// the down projection plus the residual.

#include "ops.h"

namespace blockspec_kernels {

// x [b, n, H]. Layer i: weights[4i .. 4i+3] = its qkv, o, gate_up and down blocks (GGML types in qtypes),
// norms[2i], norms[2i+1] = its input and post-attention RMSNorm weights, cache_k[i] / cache_v[i] its KV
// cache; cos / sin [b, n, 1, head_dim] for the new tokens' positions. Returns the last layer's output,
// then the outputs of the layers listed in `capture` (indices into this stack), in that order.
std::vector<at::Tensor> decoder_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef qtypes,
                                       at::TensorList norms, double eps, int64_t heads, int64_t kv_heads,
                                       const at::Tensor& cos, const at::Tensor& sin, at::TensorList cache_k,
                                       at::TensorList cache_v, at::IntArrayRef slots, at::IntArrayRef starts,
                                       int64_t length, const c10::optional<at::Tensor>& visible,
                                       at::IntArrayRef capture) {
  const int64_t layers = static_cast<int64_t>(cache_k.size());
  TORCH_CHECK(x_in.dim() == 3 && static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(qtypes.size()) == 4 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(cache_v.size()) == layers && layers > 0,
              "blockspec decoder_layers: x [b, n, H] and, per layer, 4 weights, 4 types, 2 norms, 2 caches");
  const int64_t b = x_in.size(0), n = x_in.size(1), hidden = x_in.size(2), d = cache_k[0].size(3);
  at::Tensor x = x_in.contiguous();
  std::vector<at::Tensor> out(1 + capture.size());
  const c10::optional<at::Tensor> none;
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor h = rms_norm(x, norms[2 * i], eps).view({b * n, hidden});
    at::Tensor qkv = quant_matmul(h, weights[4 * i], qtypes[4 * i], false, none);
    qkv = qkv.view({b, n, heads + 2 * kv_heads, d});
    rope_(qkv.narrow(2, 0, heads + kv_heads), cos, sin);
    at::Tensor attn = cache_attention(qkv.narrow(2, 0, heads), qkv.narrow(2, heads, kv_heads),
                                      qkv.narrow(2, heads + kv_heads, kv_heads), cache_k[i], cache_v[i],
                                      slots, starts, length, visible);
    x = quant_matmul(attn.view({b * n, heads * d}), weights[4 * i + 1], qtypes[4 * i + 1], false,
                     x.view({b * n, hidden}));
    h = rms_norm(x, norms[2 * i + 1], eps);
    at::Tensor gate_up = quant_matmul(h, weights[4 * i + 2], qtypes[4 * i + 2], false, none);
    x = quant_matmul(silu_mul(gate_up), weights[4 * i + 3], qtypes[4 * i + 3], false, x)
            .view({b, n, hidden});
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == i) out[1 + c] = x;
  }
  out[0] = x;
  return out;
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] qtypes, Tensor[] norms, float eps, int heads, "
        "int kv_heads, Tensor cos, Tensor sin, Tensor(a!)[] cache_k, Tensor(b!)[] cache_v, int[] slots, "
        "int[] starts, int length, Tensor? visible, int[] capture) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) { m.impl("decoder_layers", &blockspec_kernels::decoder_layers); }
