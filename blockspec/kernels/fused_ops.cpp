// Fused CPU fp32 inference ops for the layers' small steps: RMSNorm, the rotary embedding and the SiLU gate
// (attention: attention.cpp). On a decode step each replaces several torch ops whose dispatch costs more
// than their math (a one-row step runs ~15 of them per layer). Every result row depends on its own inputs
// only, in a fixed order: a token's values do not depend on how many rows came with it (batch invariance).

#include <vector>

#include "ops.h"
#include "simd.h"

namespace blockspec_kernels {

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
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * h, w, static_cast<float>(eps), yp + r * h, h);
  });
  return y;
}

void rms_norm_row(const float* x, const float* w, float eps, float* y, int64_t h) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < h; ++i) lanes[i % 8] += x[i] * x[i];
  const float ss =
      ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) y[i] = w ? (x[i] * scale) * w[i] : x[i] * scale;
}

// ---- rotary embedding ---------------------------------------------------------------------------------

// Neox rotation, in place, of x [b, n, heads, d] (any strides but the last) by cos / signed sin [b, n, 1, d]
// (see blockspec/layers/rotary.py): x[i] <- x[i] cos[i] + x[(i + d/2) mod d] sin[i].
void rope_(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_cpu_float(x, "rope_", "x");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.size(3) <= 1024,
              "blockspec rope_: x must be [b, n, heads, d], d even");
  const int64_t b = x.size(0), n = x.size(1), heads = x.size(2), d = x.size(3);
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  TORCH_CHECK(cs.numel() == b * n * d && sn.numel() == b * n * d, "blockspec rope_: cos/sin must hold ",
              b * n * d, " values ([b, n, 1, d])");
  float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ni = 0; ni < n; ++ni) {
      const float* c = cp + (bi * n + ni) * d;
      const float* s = sp + (bi * n + ni) * d;
      for (int64_t hi = 0; hi < heads; ++hi)
        rope_head(xp + bi * x.stride(0) + ni * x.stride(1) + hi * x.stride(2), c, s, d);
    }
  }
}

void rope_head(float* x, const float* c, const float* s, int64_t d) {
  float tmp[1024];
  const int64_t half = d / 2;
  std::copy(x, x + d, tmp);
  for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
  for (int64_t i = half; i < d; ++i) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
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
  maybe_parallel(rows, 20 * width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * 2 * width, yp + r * width, width);
  });
  return y;
}

void silu_mul_row(const float* gate_up, float* y, int64_t width) {
#ifdef BLOCKSPEC_X86
  if (avx2_fma() && width % 8 == 0) return silu_mul_avx2(gate_up, gate_up + width, y, width);
#endif
  for (int64_t i = 0; i < width; ++i) y[i] = gate_up[i] / (1.0f + exp1(-gate_up[i])) * gate_up[width + i];
}
}  // namespace blockspec_kernels

using namespace blockspec_kernels;

TORCH_LIBRARY_FRAGMENT(blockspec, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockspec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}
