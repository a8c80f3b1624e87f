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
// A product of two __half values is exact in f32 (11 + 11 significant bits,
// and its range lies within f32's normal range), so rounding it once is
// __half's own product. A product of two bf16 values has 8 + 8 significant
// bits but bf16's range: below 2^-126 f32 rounds it to its subnormal grid
// first, and past f32's largest it is inf. Rounded again to bf16 it is still
// bf16's correctly rounded product, since f32's grid is 16 bits finer than
// bf16's there too (at least 2 * 8 + 2 bits, after which a second rounding
// of a product changes nothing), and anything past f32's largest is past
// bf16's rounding threshold. The half crate's bf16 multiply on the CPU
// rounds the same two times (cuda-emulation's tests/halves.rs holds this
// chain to the correctly rounded product, subnormals and overflow included).
__device__ __forceinline__ void store(__half *p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16_rn(x); }

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
