// Products with MLX's packed affine weights (4 and 8 bits) on the CPU: one primitive, two paths.
#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace turbospark {

namespace mx = mlx::core;

// x (..., K) @ dequantize(w, scales, biases).T, in float32; w is (N, K * bits / 32) uint32,
// scales and biases (N, K / group_size) float32, all row-contiguous.
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// Whether this CPU runs the kernels (x86-64 with AVX-512 F/BW/VL, or AVX2 and FMA).
bool cpu_supported();

// The instruction set of the kernels in use: "avx512", "avx2" or "none".
std::string isa();

// Use the kernels of `name` ("avx512", "avx2"), or the widest this CPU runs ("auto").
void set_isa(const std::string& name);

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "TurboSparkQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
};

} // namespace turbospark
