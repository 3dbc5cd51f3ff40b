// GGUF block types as files store them (ggml-common.h's layouts): their sizes, and every block read as
// sub-blocks of 32 weights in one canonical form, from which both the dequantization (equal to gguf-py's
// `gguf.quants.dequantize`, bit for bit) and the int8 kernels' repacked layout (int8_pack.cpp) are built.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace blockspec_kernels {

// GGML type ids, as gguf.GGMLQuantizationType numbers them. F16 and BF16 are read as blocks of 32 values
// (64 bytes): a float weight held as stored, converted where it is used.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kF16 = 1, kBF16 = 30;
constexpr bool is_float(int64_t qtype) { return qtype == kF16 || qtype == kBF16; }

// Weights per stored block (32, or 256 for the K-quants' super-blocks) and its bytes; refuses other types.
int64_t block_elems(int64_t qtype);
int64_t block_bytes(int64_t qtype);

// One sub-block of 32 weights, as stored: `d` (fp16 bits; Q6_K: the super-block's), `m` (fp16 bits: Q4_1
// and Q5_1's min, the K-quants' dmin), the 6-bit scale and min of a Q4_K/Q5_K sub-block (sc, mn), Q6_K's
// two int8 scales (weights 0-15, 16-31), and the quants q: unsigned stored values (0..15, 0..31, 0..63),
// or Q8_0's int8 as its byte.
struct Sub {
  uint16_t d = 0, m = 0;
  uint8_t sc = 0, mn = 0;
  int8_t sa = 0, sb = 0;
  uint8_t q[32];
};

// Q4_K / Q5_K: sub-block j's 6-bit scale and min in the super-block's 12 packed bytes.
void k_scale_min(const uint8_t* scales, int64_t j, uint8_t& sc, uint8_t& mn);

// Sub-block `s` (0 .. elems / 32 - 1) of the stored block at p.
void read_sub(int64_t qtype, const uint8_t* p, int64_t s, Sub& out);
// Its bits written back into the stored block at p (which must start zeroed: bits are or-ed in).
void write_sub(int64_t qtype, const Sub& sub, int64_t s, uint8_t* p);
// Its 32 weights in fp32, as gguf-py computes them.
void dequant_sub(int64_t qtype, const Sub& sub, float* w);
// Sub-block b (weights 32 b .. 32 b + 31) of a stored row, every type (the float ones too), in fp32.
void dequant_row_sub(int64_t qtype, const uint8_t* row, int64_t b, float* w);

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace blockspec_kernels
