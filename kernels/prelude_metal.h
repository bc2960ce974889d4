// Metal prelude of the shared kernel dialect (see turbospark_mlx/_kernels.py).
// Kernel bodies are written once; this header and prelude_cuda.h give the
// same helper names on each backend. Passed to mx.fast.metal_kernel as `header`.
#pragma once
#include <metal_stdlib>
using namespace metal;

#define TS_DEVICE device
#define TS_SHARED threadgroup
#define TS_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)

// Index `slot` of a packed word holding 32/width indices of `width` bits.
inline uint ts_field(uint word, uint slot, uint width) {
  return (word >> (slot * width)) & ((1u << width) - 1u);
}

inline float ts_simd_sum(float x) { return simd_sum(x); }
inline float ts_simd_max(float x) { return simd_max(x); }
