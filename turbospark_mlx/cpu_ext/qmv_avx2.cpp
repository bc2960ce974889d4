// The kernels of qmv_kernels.h on 8-float AVX2 vectors (compiled with -mavx2 -mfma).
#include "qmv_isa.h"
#include "qmv_kernels.h"

namespace turbospark::kernels {
namespace {

struct V256 {
  using type = __m256;
  static type zero() { return _mm256_setzero_ps(); }
  static type set1(float a) { return _mm256_set1_ps(a); }
  static type add(type a, type b) { return _mm256_add_ps(a, b); }
  static type fmadd(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(type a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  // The low 8 bytes of `bytes` as 8 floats.
  static type f(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
  static type f_hi(__m128i bytes) { return f(_mm_srli_si128(bytes, 8)); }

  // Block i of 32 weights as floats (see qmv_avx512.cpp), 8 to a vector.
  struct Block {
    type q[4];
  };
  template <int bits>
  static Block weights(const uint8_t* w, int i) {
    __m128i q0, q1;
    block_bytes<bits>(w, i, q0, q1);
    return {{f(q0), f_hi(q0), f(q1), f_hi(q1)}};
  }
  static type dot(const Block& b, const float* x) {
    type a = _mm256_mul_ps(b.q[0], _mm256_loadu_ps(x));
    a = _mm256_fmadd_ps(b.q[1], _mm256_loadu_ps(x + 8), a);
    a = _mm256_fmadd_ps(b.q[2], _mm256_loadu_ps(x + 16), a);
    return _mm256_fmadd_ps(b.q[3], _mm256_loadu_ps(x + 24), a);
  }

  static void store16(float* d, __m128i q, float scale, float bias) {
    _mm256_storeu_ps(d, _mm256_fmadd_ps(f(q), set1(scale), set1(bias)));
    _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(f_hi(q), set1(scale), set1(bias)));
  }
};

} // namespace

const Kernels avx2 = kernels_on<V256>();

} // namespace turbospark::kernels
