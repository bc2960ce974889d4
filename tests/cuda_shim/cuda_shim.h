// A small CUDA shim for a CPU-side type check of the generated CUDA kernels
// (tests/test_gpu_compile.py::test_cuda_kernels_typecheck_through_shim): enough of
// the CUDA runtime names for clang -fsyntax-only on the source MLX's cuda_kernel builds.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __grid_constant__
struct uint3_ { unsigned x, y, z; };
extern uint3_ threadIdx, blockIdx, blockDim, gridDim;
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct __half { unsigned short b; __half() = default; __half(float); operator float() const; };
struct __nv_bfloat16 { unsigned short b; __nv_bfloat16() = default; __nv_bfloat16(float); operator float() const; };
void __syncthreads();
float __shfl_xor_sync(unsigned, float, int);
float __int_as_float(int);
struct Shape { int operator[](int) const; };
struct Strides { int64_t operator[](int) const; };
