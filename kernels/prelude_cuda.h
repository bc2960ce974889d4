// CUDA prelude of the shared kernel dialect (see turbospark_mlx/kernel_build.py).
// Same names as prelude_metal.h. #included by the `header` given to mx.fast.cuda_kernel.
// Thread and group indices (TS_TID, TS_GROUP_X, ...) are defined by the loader
// (kernel_build.DIALECT): MLX's Metal side scans the body text for attribute names,
// so there they are substituted textually; on CUDA they are macros before this file.
#pragma once

#define TS_SHARED __shared__
#define TS_SPTR
#define TS_GPTR
#define TS_TPTR
#define TS_FUNC __device__ __forceinline__
#define TS_BARRIER() __syncthreads()
#define TS_NEG_INF (__int_as_float(0xff800000))
#define TS_UNROLL _Pragma("unroll")
typedef unsigned int uint;

TS_FUNC float ts_exp(float x) { return expf(x); }
TS_FUNC float ts_sqrt(float x) { return sqrtf(x); }
TS_FUNC float ts_max(float a, float b) { return fmaxf(a, b); }
TS_FUNC float ts_as_float(int bits) { return __int_as_float(bits); }

// A warp is the SIMD group: 32 lanes on NVIDIA, as on Apple GPUs.
TS_FUNC float ts_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
TS_FUNC float ts_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
TS_FUNC float ts_shuffle_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
