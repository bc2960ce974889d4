// CUDA prelude of the shared kernel dialect (see turbospark_mlx/_kernels.py).
// Same helper names as prelude_metal.h. Passed to mx.fast.cuda_kernel as `header`.
#pragma once

#define TS_DEVICE
#define TS_SHARED __shared__
#define TS_BARRIER() __syncthreads()
typedef unsigned int uint;

// Index `slot` of a packed word holding 32/width indices of `width` bits.
__device__ inline uint ts_field(uint word, uint slot, uint width) {
  return (word >> (slot * width)) & ((1u << width) - 1u);
}

// A warp is the SIMD group: 32 lanes on NVIDIA, as on Apple GPUs.
__device__ inline float ts_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float ts_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
