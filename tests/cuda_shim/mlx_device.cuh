// Stand-in for MLX's "mlx/backend/cuda/device/utils.cuh" when nvcc compiles the source
// MLX's cuda_kernel builds (tests/test_gpu_compile.py::test_cuda_mma_kernel_compiles_with_nvcc):
// the fp16/bf16 types and the Shape / Strides argument types of generated signatures.
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
namespace mlx::core::cu {
struct Shape {
  int32_t v[10];
  __device__ int32_t operator[](int i) const { return v[i]; }
};
struct Strides {
  int64_t v[10];
  __device__ int64_t operator[](int i) const { return v[i]; }
};
}  // namespace mlx::core::cu
