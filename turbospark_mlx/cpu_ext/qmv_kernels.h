// The packed-weight kernels, written once over a vector type `V` (AVX-512 or AVX2) and compiled
// per instruction set (qmv_avx512.cpp, qmv_avx2.cpp). Only intrinsics here: nothing a file
// compiled without these instructions could share.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "qmv_isa.h"

namespace turbospark::kernels {

// Internal linkage: each instruction set's file gets its own copy, compiled with its flags.
namespace {

// Block i of 32 weights as 32 bytes, one per weight: for 4 bits its even elements in `a` and its
// odd ones in `b` (a byte's low and high nibbles), for 8 bits elements 0-15 and 16-31.
template <int bits>
inline void block_bytes(const uint8_t* w, int i, __m128i& a, __m128i& b) {
  if (bits == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * 16));
    a = _mm_and_si128(v, mask);
    b = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  } else {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * 32));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * 32 + 16));
  }
}

} // namespace

// out[m * out_stride + n] for m < M and n in [n0, n1): sum over groups g of
// scale * (x_m,g . q_g) + bias * sum(x_m,g), for weights of `bits` (4 or 8) in MLX's packed
// layout, each block of 32 weights converted once for all M rows. For 4 bits each row of `x` is
// permuted per block of 32 as its 16 even then 16 odd elements: a byte's low nibble is the even
// element, its high nibble the odd one. `xsum` holds each row's sum per group (M x K / gs).
template <class V, int bits, int M>
void packed_rows(const float* x, const float* xsum, const uint8_t* w, const float* s, const float* b,
                 float* out, size_t out_stride, int n0, int n1, int K, int gs) {
  const int blocks = K / 32, groups = K / gs, shift = gs == 32 ? 0 : gs == 64 ? 1 : 2;
  const size_t row_bytes = size_t(K) * bits / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const float* sr = s + size_t(n) * groups;
    const float* br = b + size_t(n) * groups;
    // Two FMA chains per row, even and odd blocks: independent chains for one row, and each row
    // summed in the same order whatever M is, so a row's result does not depend on its batch.
    typename V::type even[M], odd[M];
    for (int m = 0; m < M; ++m) {
      even[m] = V::zero();
      odd[m] = V::zero();
    }
    int i = 0;
    for (; i + 1 < blocks; i += 2) {
      const auto q0 = V::template weights<bits>(wr, i), q1 = V::template weights<bits>(wr, i + 1);
      const auto s0 = V::set1(sr[i >> shift]), s1 = V::set1(sr[(i + 1) >> shift]);
      for (int m = 0; m < M; ++m) {
        const float* xm = x + size_t(m) * K + i * 32;
        even[m] = V::fmadd(V::dot(q0, xm), s0, even[m]);
        odd[m] = V::fmadd(V::dot(q1, xm + 32), s1, odd[m]);
      }
    }
    if (i < blocks) {
      const auto q = V::template weights<bits>(wr, i);
      const auto scale = V::set1(sr[i >> shift]);
      for (int m = 0; m < M; ++m) {
        even[m] = V::fmadd(V::dot(q, x + size_t(m) * K + i * 32), scale, even[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float bias = 0.f;
      for (int g = 0; g < groups; ++g) {
        bias += br[g] * xsum[size_t(m) * groups + g];
      }
      out[m * out_stride + n] = V::sum(V::add(even[m], odd[m])) + bias;
    }
  }
}

// Rows [n0, n1) of the weight as float32 in order, row n at dst + (n - n0) * K.
template <class V, int bits>
void dequantize_rows(const uint8_t* w, const float* s, const float* b, float* dst, int n0, int n1, int K,
                     int gs) {
  const int groups = K / gs;
  const size_t row_bytes = size_t(K) * bits / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* d = dst + size_t(n - n0) * K;
    for (int k = 0; k < K; k += 32) {
      const float sc = s[size_t(n) * groups + k / gs], bi = b[size_t(n) * groups + k / gs];
      __m128i q0, q1;  // elements k .. k + 15 and k + 16 .. k + 31, one byte each
      block_bytes<bits>(wr, k / 32, q0, q1);
      if (bits == 4) {  // even and odd elements, interleaved back into order
        const __m128i even = q0;
        q0 = _mm_unpacklo_epi8(even, q1);
        q1 = _mm_unpackhi_epi8(even, q1);
      }
      V::store16(d + k, q0, sc, bi);
      V::store16(d + k + 16, q1, sc, bi);
    }
  }
}

// The table an instruction set's file exports: every kernel above on its vector type.
template <class V>
Kernels kernels_on() {
  return {{packed_rows<V, 4, 1>, packed_rows<V, 4, 2>, packed_rows<V, 4, 3>, packed_rows<V, 4, 4>},
          {packed_rows<V, 8, 1>, packed_rows<V, 8, 2>, packed_rows<V, 8, 3>, packed_rows<V, 8, 4>},
          dequantize_rows<V, 4>,
          dequantize_rows<V, 8>};
}

} // namespace turbospark::kernels
