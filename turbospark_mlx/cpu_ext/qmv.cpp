// CPU products with MLX's packed affine weights (w = scale * q + bias per group of `group_size`).
//
// A decode step on the CPU is bound by reading the weights (docs/backends.md): a one-row
// product reads the packed bytes directly, 4-bit weights being 1/8 of their float32 bytes.
// Products of more rows (prefill) dequantize the weight a tile at a time and hand each tile to
// BLAS (`cblas_sgemm`, bound like MLX's own: MKL where turbospark_mlx loaded it). Rows of a
// matrix are split over OpenMP threads, the libgomp pool MKL's GNU threading layer also uses,
// so the two do not spin against each other. The kernels themselves (qmv_kernels.h) are compiled
// for AVX-512 and for AVX2 and chosen by what the CPU has. The reference is `mx.dequantize`
// then a matmul.

#include "qmv.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "qmv_isa.h"

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int,
                            float, float*, int);

namespace turbospark {

namespace {

// Products of at most this many rows read the packed weights (kRowsPerPass rows a pass); more
// go through dequantized tiles and BLAS (crossover measured in docs/backends.md, "Packed weights").
constexpr int kMaxPackedRows = 8;
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

// The kernels in use: the widest the CPU runs, unless `set_isa` chose narrower ones.
std::atomic<const kernels::Kernels*> chosen{nullptr};

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const kernels::Kernels* widest() {
  return has_avx512() ? &kernels::avx512 : has_avx2() ? &kernels::avx2 : nullptr;
}

const kernels::Kernels* in_use() {
  auto* k = chosen.load();
  return k != nullptr ? k : widest();
}

template <int bits>
void product(const kernels::Kernels& kern, const float* x, const uint8_t* w, const float* s, const float* b,
             float* out, int M, int N, int K, int gs) {
  const auto packed = bits == 4 ? kern.packed4 : kern.packed8;
  const auto dequantize = bits == 4 ? kern.dequantize4 : kern.dequantize8;
  if (M > kMaxPackedRows) {
    const int tile = std::max(16, std::min(N, int(kTileFloats / K)));
    float* buf = scratch(size_t(tile) * K, 0);
    for (int n0 = 0; n0 < N; n0 += tile) {
      const int rows = std::min(tile, N - n0);
      split_rows(rows, [&](int lo, int hi) {
        dequantize(w, s, b, buf + size_t(lo) * K, n0 + lo, n0 + hi, K, gs);
      });
      // row-major (101): out[:, n0:n0 + rows] = x @ tile.T (111: no transpose, 112: transpose)
      cblas_sgemm(101, 111, 112, M, rows, K, 1.f, x, K, buf, K, 0.f, out + n0, N);
    }
    return;
  }
  // Up to kRowsPerPass rows per pass over the weights; 4-bit rows permuted (qmv_kernels.h).
  const int groups = K / gs, pass = std::min(M, kernels::kRowsPerPass);
  float* xp = scratch(size_t(pass) * (K + groups), 1);
  float* xsum = xp + size_t(pass) * K;
  for (int m0 = 0; m0 < M; m0 += kernels::kRowsPerPass) {
    const int rows = std::min(kernels::kRowsPerPass, M - m0);
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + size_t(m0 + r) * K;
      for (int g = 0; g < groups; ++g) {
        float acc = 0.f;
        for (int k = 0; k < gs; ++k) {
          acc += xr[g * gs + k];
        }
        xsum[size_t(r) * groups + g] = acc;
      }
      if (bits == 4) {
        float* xr_p = xp + size_t(r) * K;
        for (int k0 = 0; k0 < K; k0 += 32) {
          for (int j = 0; j < 16; ++j) {
            xr_p[k0 + j] = xr[k0 + 2 * j];
            xr_p[k0 + 16 + j] = xr[k0 + 2 * j + 1];
          }
        }
      }
    }
    const float* xk = bits == 4 ? xp : x + size_t(m0) * K;
    const auto kernel = packed[rows - 1];
    float* o = out + size_t(m0) * N;
    split_rows(N, [&](int lo, int hi) { kernel(xk, xsum, w, s, b, o, N, lo, hi, K, gs); });
  }
}

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
  return widest() != nullptr;
}

std::string isa() {
  auto* k = in_use();
  return k == &kernels::avx512 ? "avx512" : k == &kernels::avx2 ? "avx2" : "none";
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    chosen.store(nullptr);
  } else if (name == "avx512" && has_avx512()) {
    chosen.store(&kernels::avx512);
  } else if (name == "avx2" && has_avx2()) {
    chosen.store(&kernels::avx2);
  } else {
    throw std::invalid_argument("[turbospark set_isa] '" + name +
                                "' is not one this CPU runs (auto, avx512, avx2)");
  }
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
                    strides = x.strides(), kern = in_use()]() {
    if (kern == nullptr) {
      throw std::runtime_error("[turbospark quantized_matmul] needs an x86-64 CPU with AVX2 and FMA");
    }
    const float* xc = xp;
    std::unique_ptr<float[]> copy;
    if (!contiguous) {
      copy.reset(new float[size_t(M) * K]);
      gather(xp, copy.get(), shape, strides);
      xc = copy.get();
    }
    if (bits == 4) {
      product<4>(*kern, xc, wp, sp, bp, op, M, N, K, gs);
    } else {
      product<8>(*kern, xc, wp, sp, bp, op, M, N, K, gs);
    }
  });
}

} // namespace turbospark
