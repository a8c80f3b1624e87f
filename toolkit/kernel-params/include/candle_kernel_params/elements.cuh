// What the toolkit's kernels share: an element widened to the type it is
// computed in (f32 for the half types) and rounded back once, and the
// operations rounded each on their own (the _rn intrinsics), as candle's
// separate kernels and the CPU round them, so that nvcc fuses no two into
// one multiply-add. A crate's build script finds this folder in
// DEP_CANDLE_KERNEL_PARAMS_INCLUDE (build.rs), a test in
// candle_kernel_params::include_dir().
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ double load(double x) { return x; }
__device__ __forceinline__ float load(__half x) { return __half2float(x); }
__device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float *p, float x) { *p = x; }
__device__ __forceinline__ void store(double *p, double x) { *p = x; }
// A product of two half-type values is exact in f32 (11 + 11 and 8 + 8
// significant bits), so rounding it once is the half type's own product.
__device__ __forceinline__ void store(__half *p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16_rn(x); }

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
