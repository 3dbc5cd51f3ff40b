// The layer stack's weights (layer_stack.cpp) as slots: each of a layer's four weights as its parts, a fused
// weight whose parts a file stores in different block types having several.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "ops.h"

namespace blockspec_kernels {

// One of a layer's four weights (qkv, o, gate_up, down): its parts, each a tensor of blocks of one GGML
// type (a fused weight whose parts a file stores in different types has several), outputs side by side.
struct Slot {
  std::vector<const at::Tensor*> parts;
  std::vector<int64_t> qtypes;
};

// The slots of `weights` / `qtypes` (flattened: parts[k] entries belong to slot k; no parts: one each).
inline std::vector<Slot> slots_of(at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef parts) {
  TORCH_CHECK(weights.size() == qtypes.size(), "blockspec decoder_layers: one type per weight");
  std::vector<Slot> out;
  size_t at = 0;
  const size_t count = parts.empty() ? weights.size() : parts.size();
  for (size_t k = 0; k < count; ++k) {
    const int64_t n = parts.empty() ? 1 : parts[k];
    TORCH_CHECK(n >= 1 && at + n <= weights.size(), "blockspec decoder_layers: parts ", parts,
                " do not add up to the ", weights.size(), " weights");
    Slot slot;
    for (int64_t p = 0; p < n; ++p, ++at) {
      slot.parts.push_back(&weights[at]);
      slot.qtypes.push_back(qtypes[at]);
    }
    out.push_back(std::move(slot));
  }
  TORCH_CHECK(at == weights.size(), "blockspec decoder_layers: parts ", parts, " do not add up to the ",
              weights.size(), " weights");
  return out;
}

// x times a slot's parts (fp32 activations), their outputs side by side, plus `residual` if given.
inline at::Tensor slot_matmul(const at::Tensor& x, const Slot& slot,
                              const c10::optional<at::Tensor>& residual) {
  if (slot.parts.size() == 1) return quant_matmul(x, *slot.parts[0], slot.qtypes[0], false, residual);
  std::vector<at::Tensor> outs;
  const c10::optional<at::Tensor> none;
  for (size_t p = 0; p < slot.parts.size(); ++p)
    outs.push_back(quant_matmul(x, *slot.parts[p], slot.qtypes[p], false, none));
  at::Tensor y = at::cat(outs, 1);
  return residual.has_value() ? y.add_(residual->view_as(y)) : y;
}


}  // namespace blockspec_kernels
