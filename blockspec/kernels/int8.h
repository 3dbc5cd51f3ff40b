// The int8-activation matmul's parts (int8_matmul.cpp), for ops that split work among threads themselves
// (layer_stack.cpp): activations quantized row by row, and a weight's 8-output groups multiplied with them.
#pragma once

#include <cstdint>
#include <vector>

namespace blockspec_kernels {

constexpr int kPackedRows = 8;  // output rows per packed group

// Instruction-set variants: portable C++, AVX2 (maddubs/madd), AVX-VNNI (dpbusd on 256-bit registers) and
// AVX512-VNNI (dpbusd on 512-bit registers); kAuto: the best this CPU has. All give the same bits.
enum Variant : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kVnni = 3, kAvx512 = 4 };
Variant int8_resolve(int64_t requested);

// One matmul's activations: per row and block of 32, the int8 values, the scale d, their sum s, and d * s.
struct Activations {
  std::vector<int8_t> q;     // [rows, k]
  std::vector<float> d, ds;  // [rows, blocks]
  std::vector<int32_t> sum;  // [rows, blocks]
  int64_t rows = 0, blocks = 0;
  void resize(int64_t rows, int64_t k);
};

// Quantize rows [r0, r1) of `a` from x (x: row r0's values, rows ldx apart).
void quantize_activation_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, bool simd, Activations& a);

// Groups [g0, g1) (outputs 8 g0 .. min(n, 8 g1)) of packed weight w (n outputs) times every row of `a`, into
// y (rows ldy apart) plus res (rows ldr apart; null: none; may be y).
void int8_matmul_part(int64_t qtype, Variant v, const uint8_t* w, int64_t n, int64_t g0, int64_t g1,
                      const Activations& a, float* y, int64_t ldy, const float* res, int64_t ldr);

}  // namespace blockspec_kernels
