// CPU products with MLX's packed affine weights (w = scale * q + bias per group of `group_size`).
//
// A decode step on the CPU is bound by reading the weights (docs/backends.md): a one-row
// product reads the packed bytes directly, 4-bit weights being 1/8 of their float32 bytes.
// Products of more rows (prefill) dequantize the weight a tile at a time and hand each tile to
// BLAS (`cblas_sgemm`, bound like MLX's own: MKL where turbospark_mlx loaded it). Rows of a
// matrix are split over OpenMP threads, the libgomp pool MKL's GNU threading layer also uses,
// so the two do not spin against each other. The reference is `mx.dequantize` then a matmul.

#include "qmv.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int,
                            float, float*, int);

namespace turbospark {

namespace {

// Products of at most this many rows read the packed weights once per row; more go through
// dequantized tiles and BLAS (crossover measured in docs/backends.md, "Packed weights").
constexpr int kMaxPackedRows = 4;
// Floats in one dequantized tile (16 MiB), per product of more rows.
constexpr size_t kTileFloats = size_t(1) << 22;
// Rows below which a matrix is not split over threads.
constexpr int kMinRowsPerThread = 128;

template <typename F>
void split_rows(int n, F&& f) {
  int threads = std::min(omp_get_max_threads(), std::max(1, n / kMinRowsPerThread));
  if (threads <= 1) {
    f(0, n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int per = ((n + T - 1) / T + 15) & ~15;
    int lo = std::min(n, t * per), hi = std::min(n, lo + per);
    if (lo < hi) {
      f(lo, hi);
    }
  }
}

// A float buffer per thread, grown on demand and kept.
float* scratch(size_t n, int which) {
  thread_local std::unique_ptr<float[]> bufs[2];
  thread_local size_t sizes[2] = {0, 0};
  if (sizes[which] < n) {
    bufs[which].reset(new float[n]);
    sizes[which] = n;
  }
  return bufs[which].get();
}

#if defined(__x86_64__)
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// 32 four-bit weights (16 bytes) against x permuted as its 16 even then 16 odd elements: the low
// nibbles are the even elements, the high nibbles the odd ones.
TS_AVX512 inline __m512 q4_block(const uint8_t* w, const float* x) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  return _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
}

// 32 eight-bit weights.
TS_AVX512 inline __m512 q8_block(const uint8_t* w, const float* x) {
  __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16));
  __m512 fa = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a));
  __m512 fb = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  return _mm512_fmadd_ps(fb, _mm512_loadu_ps(x + 16), _mm512_mul_ps(fa, _mm512_loadu_ps(x)));
}

// out[n] for n in [n0, n1): sum over groups g of scale * (x_g . q_g) + bias * sum(x_g).
// `x` is permuted for 4 bits (q4_block); `xsum` holds the sums of x per group.
template <int bits>
TS_AVX512 void packed_rows(const float* x, const float* xsum, const uint8_t* w, const float* s,
                           const float* b, float* out, int n0, int n1, int K, int gs) {
  const int blocks = K / 32, groups = K / gs, shift = gs == 32 ? 0 : gs == 64 ? 1 : 2;
  const size_t row_bytes = size_t(K) * bits / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const float* sr = s + size_t(n) * groups;
    const float* br = b + size_t(n) * groups;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    auto block = [&](int i) {
      return bits == 4 ? q4_block(wr + i * 16, x + i * 32) : q8_block(wr + i * 32, x + i * 32);
    };
    int i = 0;
    for (; i + 1 < blocks; i += 2) {  // two accumulators: independent FMA chains
      a0 = _mm512_fmadd_ps(block(i), _mm512_set1_ps(sr[i >> shift]), a0);
      a1 = _mm512_fmadd_ps(block(i + 1), _mm512_set1_ps(sr[(i + 1) >> shift]), a1);
    }
    if (i < blocks) {
      a0 = _mm512_fmadd_ps(block(i), _mm512_set1_ps(sr[i >> shift]), a0);
    }
    float bias = 0.f;
    for (int g = 0; g < groups; ++g) {
      bias += br[g] * xsum[g];
    }
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + bias;
  }
}

// Rows [n0, n1) of the weight as float32, in order, to dst (row n at dst + (n - n0) * K).
template <int bits>
TS_AVX512 void dequantize_rows(const uint8_t* w, const float* s, const float* b, float* dst, int n0,
                               int n1, int K, int gs) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const int groups = K / gs;
  const size_t row_bytes = size_t(K) * bits / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* d = dst + size_t(n - n0) * K;
    for (int k = 0; k < K; k += 32) {
      __m512 sc = _mm512_set1_ps(s[size_t(n) * groups + k / gs]);
      __m512 bi = _mm512_set1_ps(b[size_t(n) * groups + k / gs]);
      __m128i q0, q1;
      if (bits == 4) {
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2));
        __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        q0 = _mm_unpacklo_epi8(lo, hi);
        q1 = _mm_unpackhi_epi8(lo, hi);
      } else {
        q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
        q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16));
      }
      _mm512_storeu_ps(d + k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), sc, bi));
      _mm512_storeu_ps(d + k + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), sc, bi));
    }
  }
}

template <int bits>
void product(const float* x, const uint8_t* w, const float* s, const float* b, float* out, int M, int N,
             int K, int gs) {
  if (M > kMaxPackedRows) {
    const int tile = std::max(16, std::min(N, int(kTileFloats / K)));
    float* buf = scratch(size_t(tile) * K, 0);
    for (int n0 = 0; n0 < N; n0 += tile) {
      const int rows = std::min(tile, N - n0);
      split_rows(rows, [&](int lo, int hi) {
        dequantize_rows<bits>(w, s, b, buf + size_t(lo) * K, n0 + lo, n0 + hi, K, gs);
      });
      // row-major (101): out[:, n0:n0 + rows] = x @ tile.T (111: no transpose, 112: transpose)
      cblas_sgemm(101, 111, 112, M, rows, K, 1.f, x, K, buf, K, 0.f, out + n0, N);
    }
    return;
  }
  const int groups = K / gs;
  float* xp = scratch(size_t(K) + groups, 1);
  float* xsum = xp + K;
  for (int m = 0; m < M; ++m) {
    const float* xr = x + size_t(m) * K;
    for (int g = 0; g < groups; ++g) {
      float acc = 0.f;
      for (int k = 0; k < gs; ++k) {
        acc += xr[g * gs + k];
      }
      xsum[g] = acc;
    }
    const float* xk = xr;
    if (bits == 4) {
      for (int k0 = 0; k0 < K; k0 += 32) {
        for (int j = 0; j < 16; ++j) {
          xp[k0 + j] = xr[k0 + 2 * j];
          xp[k0 + 16 + j] = xr[k0 + 2 * j + 1];
        }
      }
      xk = xp;
    }
    float* o = out + size_t(m) * N;
    split_rows(N, [&](int lo, int hi) { packed_rows<bits>(xk, xsum, w, s, b, o, lo, hi, K, gs); });
  }
}
#endif  // __x86_64__

// A row-contiguous copy of x's elements (x of any strides).
void gather(const float* src, float* dst, const mx::Shape& shape, const mx::Strides& strides) {
  size_t total = 1;
  for (auto d : shape) {
    total *= d;
  }
  for (size_t i = 0; i < total; ++i) {
    size_t rem = i;
    int64_t off = 0;
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      off += int64_t(rem % shape[d]) * strides[d];
      rem /= shape[d];
    }
    dst[i] = src[off];
  }
}

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[turbospark quantized_matmul] " + what);
}

} // namespace

bool cpu_supported() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (w.ndim() != 2 || w.dtype() != mx::uint32) {
    fail("w must be a 2-D uint32 array");
  }
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  const mx::Shape table{N, K / group_size};
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32 || scales.shape() != table ||
      biases.shape() != table) {
    fail("scales and biases must be float32 of shape (" + std::to_string(N) + ", " +
         std::to_string(K / group_size) + ")");
  }
  if (x.ndim() < 1 || x.shape(-1) != K || !mx::issubdtype(x.dtype(), mx::floating)) {
    fail("x must be floating with last dimension " + std::to_string(K));
  }
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(
      shape, mx::float32, std::make_shared<QuantizedMatmul>(stream, group_size, bits),
      {mx::astype(x, mx::float32, stream), w, scales, biases});
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[turbospark quantized_matmul] runs on the CPU only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& scales = inputs[2];
  auto& biases = inputs[3];
  auto& out = outputs[0];
  for (auto* a : {&w, &scales, &biases}) {
    if (!a->flags().row_contiguous) {
      throw std::runtime_error("[turbospark quantized_matmul] w, scales and biases must be row-contiguous");
    }
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  encoder.set_output_array(out);
  const int K = x.shape(-1), N = w.shape(0), M = int(x.size() / K);
  encoder.dispatch([xp = x.data<float>(), wp = w.data<uint8_t>(), sp = scales.data<float>(),
                    bp = biases.data<float>(), op = out.data<float>(), M, N, K, gs = group_size_,
                    bits = bits_, contiguous = x.flags().row_contiguous, shape = x.shape(),
                    strides = x.strides()]() {
#if defined(__x86_64__)
    const float* xc = xp;
    std::unique_ptr<float[]> copy;
    if (!contiguous) {
      copy.reset(new float[size_t(M) * K]);
      gather(xp, copy.get(), shape, strides);
      xc = copy.get();
    }
    if (bits == 4) {
      product<4>(xc, wp, sp, bp, op, M, N, K, gs);
    } else {
      product<8>(xc, wp, sp, bp, op, M, N, K, gs);
    }
#else
    throw std::runtime_error("[turbospark quantized_matmul] needs an x86-64 CPU with AVX-512");
#endif
  });
}

} // namespace turbospark
