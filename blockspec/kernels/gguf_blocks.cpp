// The stored GGUF block types read as sub-blocks of 32 (gguf_blocks.h), their dequantization, and the row
// lookup op (an embedding from blocks). Every bit of every supported block is read, so any byte pattern is a
// block and round-trips through read_sub / write_sub.

#include <torch/extension.h>

#include <cmath>

#include "gguf_blocks.h"

namespace blockspec_kernels {

int64_t block_elems(int64_t qtype) {
  return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K ? 256 : 32;
}

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;   // d, qs[16]: w = d (q - 8)
    case kQ4_1: return 20;   // d, m, qs[16]: w = d q + m
    case kQ5_0: return 22;   // d, qh[4], qs[16]: w = d (q - 16)
    case kQ5_1: return 24;   // d, m, qh[4], qs[16]: w = d q + m
    case kQ8_0: return 34;   // d, int8 qs[32]: w = d q
    case kQ4_K: return 144;  // d, dmin, scales[12], qs[128]: w = d sc q - dmin mn
    case kQ5_K: return 176;  // d, dmin, scales[12], qh[32], qs[128]
    case kQ6_K: return 210;  // ql[128], qh[64], int8 scales[16], d: w = d sc (q - 32)
    case kF16:
    case kBF16: return 64;   // 32 values
  }
  TORCH_CHECK(false, "blockspec kernels: unsupported GGML type id ", qtype,
              "; supported: 1 (F16), 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K), "
              "14 (Q6_K), 30 (BF16)");
  return 0;
}

// ggml's get_scale_min_k4.
void k_scale_min(const uint8_t* s, int64_t j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

namespace {

void put_scale_min(uint8_t* s, int64_t j, uint8_t sc, uint8_t mn) {
  if (j < 4) {
    s[j] |= sc & 63, s[j + 4] |= mn & 63;
  } else {
    s[j + 4] |= (sc & 0xF) | ((mn & 0xF) << 4);
    s[j - 4] |= (sc >> 4) << 6, s[j] |= (mn >> 4) << 6;
  }
}

// 32 nibble-packed quants (byte j: weight j low, weight j + 16 high) plus an optional u32 of fifth bits.
void read_legacy(const uint8_t* qs, const uint8_t* qh, Sub& out) {
  uint32_t high = 0;
  if (qh != nullptr) std::memcpy(&high, qh, 4);
  for (int j = 0; j < 16; ++j) {
    out.q[j] = (qs[j] & 0xF) | (((high >> j) & 1) << 4);
    out.q[j + 16] = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
  }
}

void write_legacy(const Sub& sub, uint8_t* qs, uint8_t* qh) {
  uint32_t high = 0;
  for (int j = 0; j < 16; ++j) {
    qs[j] = (sub.q[j] & 0xF) | ((sub.q[j + 16] & 0xF) << 4);
    high |= static_cast<uint32_t>((sub.q[j] >> 4) & 1) << j;
    high |= static_cast<uint32_t>((sub.q[j + 16] >> 4) & 1) << (j + 16);
  }
  if (qh != nullptr) std::memcpy(qh, &high, 4);
}

// Q6_K: weight l of sub-block s sits at element e of half h; its low nibble in ql, top two bits in qh.
struct Q6Place {
  int64_t ql, ql_shift, qh, qh_shift;
};
inline Q6Place q6_place(int64_t s, int64_t l) {
  const int64_t h = s / 4, e = 32 * (s % 4) + l;
  return {64 * h + e % 64, 4 * (e / 64), 32 * h + e % 32, 2 * (e / 32)};
}

}  // namespace

void read_sub(int64_t qtype, const uint8_t* p, int64_t s, Sub& out) {
  switch (qtype) {
    case kQ4_0: out.d = load_u16(p); return read_legacy(p + 2, nullptr, out);
    case kQ4_1: out.d = load_u16(p), out.m = load_u16(p + 2); return read_legacy(p + 4, nullptr, out);
    case kQ5_0: out.d = load_u16(p); return read_legacy(p + 6, p + 2, out);
    case kQ5_1: out.d = load_u16(p), out.m = load_u16(p + 2); return read_legacy(p + 8, p + 4, out);
    case kQ8_0: out.d = load_u16(p); std::memcpy(out.q, p + 2, 32); return;
    case kQ4_K:
    case kQ5_K: {
      out.d = load_u16(p), out.m = load_u16(p + 2);
      k_scale_min(p + 4, s, out.sc, out.mn);
      const uint8_t* qs = p + (qtype == kQ4_K ? 16 : 48) + 32 * (s / 2);
      for (int l = 0; l < 32; ++l) {
        out.q[l] = (qs[l] >> (4 * (s % 2))) & 0xF;
        if (qtype == kQ5_K) out.q[l] |= ((p[16 + l] >> s) & 1) << 4;
      }
      return;
    }
    case kQ6_K: {
      out.d = load_u16(p + 208);
      out.sa = static_cast<int8_t>(p[192 + 2 * s]), out.sb = static_cast<int8_t>(p[192 + 2 * s + 1]);
      for (int l = 0; l < 32; ++l) {
        const Q6Place at = q6_place(s, l);
        out.q[l] = ((p[at.ql] >> at.ql_shift) & 0xF) | (((p[128 + at.qh] >> at.qh_shift) & 3) << 4);
      }
      return;
    }
  }
  block_bytes(qtype);  // refuses the type
}

void write_sub(int64_t qtype, const Sub& sub, int64_t s, uint8_t* p) {
  switch (qtype) {
    case kQ4_0: std::memcpy(p, &sub.d, 2); return write_legacy(sub, p + 2, nullptr);
    case kQ4_1:
      std::memcpy(p, &sub.d, 2), std::memcpy(p + 2, &sub.m, 2);
      return write_legacy(sub, p + 4, nullptr);
    case kQ5_0: std::memcpy(p, &sub.d, 2); return write_legacy(sub, p + 6, p + 2);
    case kQ5_1:
      std::memcpy(p, &sub.d, 2), std::memcpy(p + 2, &sub.m, 2);
      return write_legacy(sub, p + 8, p + 4);
    case kQ8_0: std::memcpy(p, &sub.d, 2), std::memcpy(p + 2, sub.q, 32); return;
    case kQ4_K:
    case kQ5_K: {
      std::memcpy(p, &sub.d, 2), std::memcpy(p + 2, &sub.m, 2);
      put_scale_min(p + 4, s, sub.sc, sub.mn);
      uint8_t* qs = p + (qtype == kQ4_K ? 16 : 48) + 32 * (s / 2);
      for (int l = 0; l < 32; ++l) {
        qs[l] |= (sub.q[l] & 0xF) << (4 * (s % 2));
        if (qtype == kQ5_K) p[16 + l] |= ((sub.q[l] >> 4) & 1) << s;
      }
      return;
    }
    case kQ6_K: {
      std::memcpy(p + 208, &sub.d, 2);
      p[192 + 2 * s] = static_cast<uint8_t>(sub.sa), p[192 + 2 * s + 1] = static_cast<uint8_t>(sub.sb);
      for (int l = 0; l < 32; ++l) {
        const Q6Place at = q6_place(s, l);
        p[at.ql] |= (sub.q[l] & 0xF) << at.ql_shift;
        p[128 + at.qh] |= ((sub.q[l] >> 4) & 3) << at.qh_shift;
      }
      return;
    }
  }
  block_bytes(qtype);
}

// gguf-py's formulas, rounding where it rounds: d q + m and d sc q - dmin mn have exact products (few
// significant bits), so one fma is its one rounding; Q6_K's (d sc) (q - 32) rounds the second product.
void dequant_sub(int64_t qtype, const Sub& sub, float* w) {
  const float d = half_to_float(sub.d);
  switch (qtype) {
    case kQ4_0:
    case kQ5_0: {
      const int offset = qtype == kQ4_0 ? 8 : 16;
      for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(sub.q[j] - offset);
      return;
    }
    case kQ4_1:
    case kQ5_1: {
      const float m = half_to_float(sub.m);
      for (int j = 0; j < 32; ++j) w[j] = std::fma(static_cast<float>(sub.q[j]), d, m);
      return;
    }
    case kQ8_0:
      for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(sub.q[j]));
      return;
    case kQ4_K:
    case kQ5_K: {
      const float scale = d * static_cast<float>(sub.sc);
      const float min = half_to_float(sub.m) * static_cast<float>(sub.mn);
      for (int j = 0; j < 32; ++j) w[j] = std::fma(static_cast<float>(sub.q[j]), scale, -min);
      return;
    }
    case kQ6_K: {
      const float a = d * static_cast<float>(sub.sa), b = d * static_cast<float>(sub.sb);
      for (int j = 0; j < 32; ++j) w[j] = (j < 16 ? a : b) * static_cast<float>(sub.q[j] - 32);
      return;
    }
  }
  block_bytes(qtype);
}

void dequant_row_sub(int64_t qtype, const uint8_t* row, int64_t b, float* w) {
  if (is_float(qtype)) {
    for (int j = 0; j < 32; ++j) {
      const uint16_t bits = load_u16(row + 64 * b + 2 * j);
      if (qtype == kF16) {
        w[j] = half_to_float(bits);
      } else {
        const uint32_t wide = static_cast<uint32_t>(bits) << 16;  // bf16: the top half of a float32
        std::memcpy(w + j, &wide, 4);
      }
    }
    return;
  }
  const int64_t subs = block_elems(qtype) / 32;
  Sub sub;
  read_sub(qtype, row + b / subs * block_bytes(qtype), b % subs, sub);
  dequant_sub(qtype, sub, w);
}

// Rows `ids` of the dequantized weight [len(ids), K] (an embedding lookup from stored blocks).
at::Tensor quant_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blockspec quant_rows: blocks must be a contiguous 2-D uint8 tensor");
  const int64_t bytes = block_bytes(qtype), elems = block_elems(qtype), nblocks = blocks.size(1) / bytes;
  const int64_t k = nblocks * elems;
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), k}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < blocks.size(0), "blockspec quant_rows: row ", ip[i],
                " is outside [0, ", blocks.size(0), ")");
    for (int64_t b = 0; b < k / 32; ++b)
      dequant_row_sub(qtype, w + ip[i] * blocks.size(1), b, op + i * k + b * 32);
  }
  return out;
}

}  // namespace blockspec_kernels

TORCH_LIBRARY_FRAGMENT(blockspec, m) { m.def("quant_rows(Tensor blocks, Tensor ids, int qtype) -> Tensor"); }

TORCH_LIBRARY_IMPL(blockspec, CPU, m) { m.impl("quant_rows", &blockspec_kernels::quant_rows); }
