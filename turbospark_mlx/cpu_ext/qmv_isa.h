// The kernels of one instruction set, as plain function pointers (qmv_avx512.cpp, qmv_avx2.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace turbospark::kernels {

// Rows of a product the packed kernels take in one pass over the weights.
constexpr int kRowsPerPass = 4;

using PackedRows = void (*)(const float* x, const float* xsum, const uint8_t* w, const float* s,
                            const float* b, float* out, size_t out_stride, int n0, int n1, int K, int gs);
using DequantizeRows = void (*)(const uint8_t* w, const float* s, const float* b, float* dst, int n0,
                                int n1, int K, int gs);

struct Kernels {
  // [M - 1]: M rows of x in one pass over the weights
  PackedRows packed4[kRowsPerPass], packed8[kRowsPerPass];
  DequantizeRows dequantize4, dequantize8;
};

extern const Kernels avx512;
extern const Kernels avx2;

} // namespace turbospark::kernels
