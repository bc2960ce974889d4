// Metal prelude of the shared kernel dialect (see turbospark_mlx/kernel_build.py).
// Kernel bodies are written once; this header and prelude_cuda.h give the
// same names on each backend. Passed to mx.fast.metal_kernel as `header`.
#pragma once
#include <metal_stdlib>
using namespace metal;

#define TS_SHARED threadgroup
#define TS_SPTR threadgroup
#define TS_GPTR device
#define TS_TPTR thread
#define TS_FUNC inline
#define TS_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define TS_NEG_INF (-INFINITY)
#define TS_UNROLL _Pragma("clang loop unroll(full)")

TS_FUNC float ts_exp(float x) { return metal::exp(x); }
TS_FUNC float ts_sqrt(float x) { return metal::sqrt(x); }
TS_FUNC float ts_max(float a, float b) { return metal::fmax(a, b); }
TS_FUNC float ts_as_float(int bits) { return as_type<float>(bits); }

TS_FUNC float ts_simd_sum(float x) { return simd_sum(x); }
TS_FUNC float ts_simd_max(float x) { return simd_max(x); }
TS_FUNC float ts_shuffle_xor(float x, int mask) { return simd_shuffle_xor(x, ushort(mask)); }
