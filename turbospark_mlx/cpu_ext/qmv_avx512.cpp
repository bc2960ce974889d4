// The kernels of qmv_kernels.h on 16-float AVX-512 vectors (compiled with -mavx512f/bw/vl).
#include "qmv_isa.h"
#include "qmv_kernels.h"

namespace turbospark::kernels {
namespace {

struct V512 {
  using type = __m512;
  static type zero() { return _mm512_setzero_ps(); }
  static type set1(float a) { return _mm512_set1_ps(a); }
  static type add(type a, type b) { return _mm512_add_ps(a, b); }
  static type fmadd(type a, type b, type c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(type a) { return _mm512_reduce_add_ps(a); }
  static type f(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

  // Block i of 32 weights as floats: the even then the odd elements for 4 bits (x permuted
  // to match), in order for 8 bits.
  struct Block {
    type lo, hi;
  };
  template <int bits>
  static Block weights(const uint8_t* w, int i) {
    __m128i q0, q1;
    block_bytes<bits>(w, i, q0, q1);
    return {f(q0), f(q1)};
  }
  // A vector whose lanes sum to the block's dot product with x[0:32].
  static type dot(const Block& q, const float* x) {
    return _mm512_fmadd_ps(q.hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(q.lo, _mm512_loadu_ps(x)));
  }

  // 16 bytes of weights, dequantized, to 16 floats.
  static void store16(float* d, __m128i q, float scale, float bias) {
    _mm512_storeu_ps(d, _mm512_fmadd_ps(f(q), set1(scale), set1(bias)));
  }
};

} // namespace

const Kernels avx512 = kernels_on<V512>();

} // namespace turbospark::kernels
