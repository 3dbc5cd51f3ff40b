// A stack of Llama decoder layers whose linears are held as GGUF blocks, run as one op on the CPU: the ops
// the Python layers call (blockspec/models/target.py, DecoderLayer) in the same order on the same values,
// without a trip through Python between them (on a one-token step, that trip costs more than the
// attention). Per layer: RMSNorm, the fused qkv projection, rotary on q and k in place, the KV-cache write
// and attention, the o projection plus the residual, RMSNorm, the fused gate/up projection, the SiLU gate,
// the down projection plus the residual. The blocks are as stored (fp32 activations) or repacked for int8
// activations (`int8`), every layer alike.

#include <omp.h>

#include "attention.h"
#include "int8.h"
#include "layer_slots.h"
#include "ops.h"

namespace blockspec_kernels {
namespace {

// [s0, s1): thread t's share of `total` items among `threads`, in whole units of `align` (the last share
// takes the rest).
inline void share(int64_t total, int64_t align, int t, int threads, int64_t& s0, int64_t& s1) {
  const int64_t units = (total + align - 1) / align;
  s0 = std::min(total, units * t / threads * align);
  s1 = std::min(total, units * (t + 1) / threads * align);
}

// The int8-activation stack: every layer's ops on one team of threads, which splits each op's rows, output
// groups or attention items among itself and meets at a barrier between dependent ops (on a one-row step the
// barriers cost far less than a thread-pool dispatch per op). Each value is computed by the same code as the
// ops called one by one (rms_norm_row, int8_matmul_part, rope_head, attend_items, silu_mul_row): same bits.
std::vector<at::Tensor> int8_stack(const at::Tensor& x_in, const std::vector<Slot>& weights,
                                   at::TensorList norms, at::TensorList qk_norms, float eps, int64_t heads,
                                   int64_t kv_heads,
                                   int64_t intermediate, const at::Tensor& cos, const at::Tensor& sin,
                                   at::TensorList cache_k, at::TensorList cache_v, at::IntArrayRef slots,
                                   at::IntArrayRef starts, int64_t length,
                                   const c10::optional<at::Tensor>& visible, at::IntArrayRef capture) {
  const int64_t layers = static_cast<int64_t>(cache_k.size());
  const int64_t b = x_in.size(0), n = x_in.size(1), hidden = x_in.size(2), d = cache_k[0].size(3);
  const int64_t rows = b * n, qkv_width = (heads + 2 * kv_heads) * d, attn_width = heads * d;
  const int64_t max_len = cache_k[0].size(2);
  // Every check before the team starts: nothing may throw inside it.
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && hidden % 32 == 0 && attn_width % 32 == 0 &&
                  intermediate % 32 == 0 && heads % kv_heads == 0 && d % 8 == 0 && d <= 256,
              "blockspec decoder_layers: int8 activations need float32 x, widths that are multiples of 32 "
              "and a head_dim that is a multiple of 8, at most 256");
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "blockspec decoder_layers: cos/sin must be contiguous [b, n, 1, d]");
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(cache_k[i].is_contiguous() && cache_v[i].is_contiguous() &&
                    cache_k[i].sizes() == cache_k[0].sizes() && cache_v[i].sizes() == cache_k[0].sizes() &&
                    cache_k[i].scalar_type() == at::kFloat && cache_v[i].scalar_type() == at::kFloat &&
                    cache_k[i].size(1) == kv_heads,
                "blockspec decoder_layers: caches must be contiguous float32 [slots, kv_heads, max_len, d]");
    TORCH_CHECK(norms[2 * i].numel() == hidden && norms[2 * i + 1].numel() == hidden &&
                    norms[2 * i].is_contiguous() && norms[2 * i + 1].is_contiguous(),
                "blockspec decoder_layers: norm weights must hold ", hidden, " values");
    if (!qk_norms.empty())
      TORCH_CHECK(qk_norms[2 * i].numel() == d && qk_norms[2 * i + 1].numel() == d &&
                      qk_norms[2 * i].is_contiguous() && qk_norms[2 * i + 1].is_contiguous(),
                  "blockspec decoder_layers: q/k norm weights must hold ", d, " values");
    const int64_t widths[4][2] = {{qkv_width, hidden}, {hidden, attn_width}, {2 * intermediate, hidden},
                                  {hidden, intermediate}};
    for (int j = 0; j < 4; ++j) {
      const Slot& slot = weights[4 * i + j];
      int64_t groups = 0;
      for (size_t p = 0; p < slot.parts.size(); ++p) {
        const at::Tensor& w = *slot.parts[p];
        TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                        w.size(1) % (widths[j][1] / 32) == 0,
                    "blockspec decoder_layers: layer ", i, " weight ", j, " is not a packed [", widths[j][0],
                    ", ", widths[j][1], "] weight");
        groups += w.size(0);
      }
      // parts meet on whole groups of 8 outputs (their widths: heads x head_dim, or the intermediate size)
      TORCH_CHECK(groups == (widths[j][0] + kPackedRows - 1) / kPackedRows &&
                      (slot.parts.size() == 1 || widths[j][0] == groups * kPackedRows),
                  "blockspec decoder_layers: layer ", i, " weight ", j, " is not a packed [", widths[j][0],
                  ", ", widths[j][1], "] weight");
    }
  }
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == b && static_cast<int64_t>(starts.size()) == b &&
                  length <= max_len,
              "blockspec decoder_layers: one slot and start per batch row, length within the cache");
  for (int64_t bi = 0; bi < b; ++bi)
    TORCH_CHECK(slots[bi] >= 0 && slots[bi] < cache_k[0].size(0) && starts[bi] >= 0 &&
                    starts[bi] + n <= max_len,
                "blockspec decoder_layers: row ", bi, " (slot ", slots[bi], ", start ", starts[bi],
                ") is outside the cache");
  at::Tensor keep;
  if (visible.has_value()) {
    keep = visible->contiguous();
    TORCH_CHECK(keep.scalar_type() == at::kBool && keep.dim() == 3 && keep.size(0) == b &&
                    keep.size(1) == n && keep.size(2) == length,
                "blockspec decoder_layers: visible must be bool [b, n, L]");
  }

  const Variant v = int8_resolve(kAuto);
  const bool simd = v != kPortable;
  const auto f32 = x_in.options();
  at::Tensor x = x_in.contiguous().clone().view({rows, hidden});  // the residual stream, updated in place
  at::Tensor h = at::empty({rows, hidden}, f32), qkv = at::empty({rows, qkv_width}, f32);
  at::Tensor attn = at::empty({rows, attn_width}, f32), gate_up = at::empty({rows, 2 * intermediate}, f32);
  at::Tensor mlp = at::empty({rows, intermediate}, f32);
  const int64_t captured = static_cast<int64_t>(capture.size());
  at::Tensor features = at::empty({b, n, captured * hidden}, f32);  // the captured layers side by side
  float* fp = features.data_ptr<float>();
  Activations act_hidden, act_attn, act_mlp;
  act_hidden.resize(rows, hidden), act_attn.resize(rows, attn_width), act_mlp.resize(rows, intermediate);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *attnp = attn.data_ptr<float>(), *gup = gate_up.data_ptr<float>(), *mlpp = mlp.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AttentionArgs args{};
  args.q = qkvp, args.out = attnp, args.visible = keep.defined() ? keep.data_ptr<bool>() : nullptr;
  args.slots = slots.data();
  args.b = b, args.n = n, args.heads = heads, args.kv_heads = kv_heads, args.length = length, args.d = d;
  args.qs[0] = n * qkv_width, args.qs[1] = qkv_width, args.qs[2] = d;
  args.ks[0] = args.vs[0] = kv_heads * max_len * d;
  args.ks[1] = args.vs[1] = max_len * d;
  args.ks[2] = args.vs[2] = d;
  args.scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t rotated = heads + kv_heads;  // q and k heads per row

  const int team = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    int64_t s0, s1;
    // Rows [s0, s1) of this thread: y = norm(x) quantized into act.
    auto norm_rows = [&](const float* w, Activations& act) {
      share(rows, 1, t, threads, s0, s1);
      for (int64_t r = s0; r < s1; ++r) rms_norm_row(xp + r * hidden, w, eps, hp + r * hidden, hidden);
      quantize_activation_rows(hp + s0 * hidden, hidden, s0, s1, simd, act);
    };
    // This thread's output groups of a weight with `width` outputs (whole pairs of groups), part by part.
    auto project = [&](int64_t i, int j, int64_t width, const Activations& act, float* y, const float* res) {
      const Slot& slot = weights[4 * i + j];
      if (slot.parts.size() == 1) {
        const at::Tensor& w = *slot.parts[0];
        share(w.size(0), 2, t, threads, s0, s1);
        return int8_matmul_part(slot.qtypes[0], v, w.data_ptr<uint8_t>(), width, s0, s1, act, y, width, res,
                                width);
      }
      share((width + kPackedRows - 1) / kPackedRows, 2, t, threads, s0, s1);
      int64_t first = 0;  // the part's first group
      for (size_t p = 0; p < slot.parts.size(); ++p) {
        const at::Tensor& w = *slot.parts[p];
        const int64_t g0 = std::max(s0, first), g1 = std::min(s1, first + w.size(0));
        const int64_t at = first * kPackedRows;
        if (g0 < g1)
          int8_matmul_part(slot.qtypes[p], v, w.data_ptr<uint8_t>(), w.size(0) * kPackedRows, g0 - first,
                           g1 - first, act, y + at, width, res ? res + at : nullptr, width);
        first += w.size(0);
      }
    };
    for (int64_t i = 0; i < layers; ++i) {
      norm_rows(norms[2 * i].data_ptr<float>(), act_hidden);
#pragma omp barrier
      project(i, 0, qkv_width, act_hidden, qkvp, nullptr);
#pragma omp barrier
      // Each row's q and k heads normed (Qwen3) and rotated; a k head then goes into the cache with its v.
      float* ck = cache_k[i].data_ptr<float>();
      float* cv = cache_v[i].data_ptr<float>();
      const float* qn = qk_norms.empty() ? nullptr : qk_norms[2 * i].data_ptr<float>();
      const float* kn = qk_norms.empty() ? nullptr : qk_norms[2 * i + 1].data_ptr<float>();
      share(rows * rotated, 1, t, threads, s0, s1);
      for (int64_t item = s0; item < s1; ++item) {
        const int64_t r = item / rotated, head = item % rotated;
        float* xh = qkvp + r * qkv_width + head * d;
        if (qn != nullptr) rms_norm_row(xh, head < heads ? qn : kn, eps, xh, d);
        rope_head(xh, cp + r * d, sp + r * d, d);
        if (head < heads) continue;
        const int64_t g = head - heads, bi = r / n, ni = r % n;
        const int64_t at_row = ((slots[bi] * kv_heads + g) * max_len + starts[bi] + ni) * d;
        std::copy_n(xh, d, ck + at_row);
        std::copy_n(xh + kv_heads * d, d, cv + at_row);
      }
#pragma omp barrier
      args.k = ck, args.v = cv;
      share(attention_items(args, threads), 1, t, threads, s0, s1);
      attend_items(args, s0, s1, threads);
#pragma omp barrier
      share(rows, 1, t, threads, s0, s1);
      quantize_activation_rows(attnp + s0 * attn_width, attn_width, s0, s1, simd, act_attn);
#pragma omp barrier
      project(i, 1, hidden, act_attn, xp, xp);
#pragma omp barrier
      norm_rows(norms[2 * i + 1].data_ptr<float>(), act_hidden);
#pragma omp barrier
      project(i, 2, 2 * intermediate, act_hidden, gup, nullptr);
#pragma omp barrier
      share(rows, 1, t, threads, s0, s1);
      for (int64_t r = s0; r < s1; ++r)
        silu_mul_row(gup + r * 2 * intermediate, mlpp + r * intermediate, intermediate);
      quantize_activation_rows(mlpp + s0 * intermediate, intermediate, s0, s1, simd, act_mlp);
#pragma omp barrier
      project(i, 3, hidden, act_mlp, xp, xp);
#pragma omp barrier
      share(rows, 1, t, threads, s0, s1);
      for (int64_t c = 0; c < captured; ++c)
        if (capture[c] == i)
          for (int64_t r = s0; r < s1; ++r)
            std::copy_n(xp + r * hidden, hidden, fp + (r * captured + c) * hidden);
    }
  }
  return {x.view({b, n, hidden}), features};
}

}  // namespace

// x [b, n, H]. Layer i: weights[4i .. 4i+3] = its qkv, o, gate_up and down blocks (GGML types in qtypes;
// with `parts`, weight slot k is parts[k] consecutive entries of weights and qtypes, side by side),
// norms[2i], norms[2i+1] = its input and post-attention RMSNorm weights, qk_norms[2i], qk_norms[2i+1] its
// per-head q and k RMSNorm weights (Qwen3; empty: none), cache_k[i] / cache_v[i] its KV
// cache; cos / sin [b, n, 1, head_dim] for the new tokens' positions. Returns the last layer's output and
// the outputs of the layers listed in `capture` (indices into this stack) side by side in that order,
// [b, n, len(capture) * H].
std::vector<at::Tensor> decoder_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef qtypes,
                                       at::TensorList norms, at::TensorList qk_norms, double eps,
                                       int64_t heads, int64_t kv_heads, int64_t intermediate,
                                       const at::Tensor& cos, const at::Tensor& sin, at::TensorList cache_k,
                                       at::TensorList cache_v, at::IntArrayRef slots, at::IntArrayRef starts,
                                       int64_t length, const c10::optional<at::Tensor>& visible,
                                       at::IntArrayRef capture, bool int8, at::IntArrayRef parts) {
  const int64_t layers = static_cast<int64_t>(cache_k.size());
  const std::vector<Slot> ws = slots_of(weights, qtypes, parts);
  TORCH_CHECK(x_in.dim() == 3 && static_cast<int64_t>(ws.size()) == 4 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(cache_v.size()) == layers && layers > 0,
              "blockspec decoder_layers: x [b, n, H] and, per layer, 4 weights, 4 types, 2 norms, 2 caches");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "blockspec decoder_layers: q/k norms: none, or a q and a k weight per layer");
  if (int8)
    return int8_stack(x_in, ws, norms, qk_norms, static_cast<float>(eps), heads, kv_heads,
                      intermediate, cos, sin, cache_k, cache_v, slots, starts, length, visible, capture);
  const int64_t b = x_in.size(0), n = x_in.size(1), hidden = x_in.size(2), d = cache_k[0].size(3);
  at::Tensor x = x_in.contiguous();
  std::vector<at::Tensor> captured(capture.size());
  const c10::optional<at::Tensor> none;
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor h = rms_norm(x, norms[2 * i], eps).view({b * n, hidden});
    at::Tensor qkv = slot_matmul(h, ws[4 * i], none);
    qkv = qkv.view({b, n, heads + 2 * kv_heads, d});
    if (!qk_norms.empty()) {
      qkv.narrow(2, 0, heads).copy_(rms_norm(qkv.narrow(2, 0, heads), qk_norms[2 * i], eps));
      at::Tensor k = qkv.narrow(2, heads, kv_heads);
      k.copy_(rms_norm(k, qk_norms[2 * i + 1], eps));
    }
    rope_(qkv.narrow(2, 0, heads + kv_heads), cos, sin);
    at::Tensor attn = cache_attention(qkv.narrow(2, 0, heads), qkv.narrow(2, heads, kv_heads),
                                      qkv.narrow(2, heads + kv_heads, kv_heads), cache_k[i], cache_v[i],
                                      slots, starts, length, visible);
    x = slot_matmul(attn.view({b * n, heads * d}), ws[4 * i + 1], x.view({b * n, hidden}));
    h = rms_norm(x, norms[2 * i + 1], eps);
    at::Tensor gate_up = slot_matmul(h, ws[4 * i + 2], none);
    x = slot_matmul(silu_mul(gate_up), ws[4 * i + 3], x).view({b, n, hidden});
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == i) captured[c] = x;
  }
  if (captured.empty()) return {x, at::empty({b, n, 0}, x.options())};
  return {x, at::cat(captured, -1)};
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] qtypes, Tensor[] norms, Tensor[] qk_norms, "
        "float eps, int heads, int kv_heads, int intermediate, Tensor cos, Tensor sin, Tensor(a!)[] cache_k, "
        "Tensor(b!)[] cache_v, int[] slots, int[] starts, int length, Tensor? visible, int[] capture, "
        "bool int8=False, int[] parts=[]) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("decoder_layers", &blockspec_kernels::decoder_layers);
}
