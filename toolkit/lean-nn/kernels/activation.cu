// The product's gradient of a ReLU or GELU layer, `g * act'(saved)`, in one
// pass on a GPU: the arithmetic of the composed operations in src/linear.rs
// (`grads` and `gelu_grad`), in the same order and with the same roundings,
// into one new tensor where they make one per operation.
//
// Each product and sum is rounded on its own (the _rn intrinsics), as
// candle's separate kernels round them, so that nvcc cannot fuse two of
// them into one multiply-add. candle's multiplications and additions by a
// scalar (its `affine` kernel, `x * mul + add`) are compiled to one fused
// multiply-add, which `affine` below is; its tanh is the CUDA math
// library's. GELU's derivative is computed in f32
// (f64 for f64) and rounded to the element type before the product, as the
// composed path's casts do.
#include "candle_kernel_params/elements.cuh"

// candle's `affine(mul, add)`.
__device__ __forceinline__ float affine(float x, float m, float a) { return __fmaf_rn(x, m, a); }
__device__ __forceinline__ double affine(double x, double m, double a) { return __fma_rn(x, m, a); }
__device__ __forceinline__ float th(float x) { return tanhf(x); }
__device__ __forceinline__ double th(double x) { return tanh(x); }

// The derivative of candle's tanh-approximated GELU, as `gelu_grad`
// composes it: each constant is the f64 literal cast to the element type,
// as candle casts an affine's scalars.
template <typename F>
__device__ __forceinline__ F gelu_grad(F z) {
  F cube = mul(mul(z, z), z);
  F t = th(add(affine(cube, (F)0.0356774, (F)0), affine(z, (F)0.797885, (F)0)));
  F inner = add(affine(cube, (F)0.0535161, (F)0), affine(z, (F)0.398942, (F)0));
  F one_minus = affine(mul(t, t), (F)-1, (F)1);
  return affine(add(affine(t, (F)0.5, (F)0), mul(inner, one_minus)), (F)1, (F)0.5);
}

// A value rounded to the element type, and back: what a cast to it keeps.
__device__ __forceinline__ float round_to(float x, float) { return x; }
__device__ __forceinline__ double round_to(double x, double) { return x; }
__device__ __forceinline__ float round_to(float x, __half) {
  return __half2float(__float2half_rn(x));
}
__device__ __forceinline__ float round_to(float x, __nv_bfloat16) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

#define EACH(n) \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)

// `out = g * (saved > 0)` (the mask cast to the element type, then the
// product: a negative gradient times 0 is -0, as candle's is), and
// `out = g * gelu'(z)`.
#define ACTIVATION_GRAD(SUFFIX, T, F)                                                   \
  extern "C" __global__ void relu_grad_##SUFFIX(T *out, const T *g, const T *saved,     \
                                               size_t n) {                              \
    EACH(n) store(&out[i], mul(load(g[i]), load(saved[i]) > (F)0 ? (F)1 : (F)0));       \
  }                                                                                     \
  extern "C" __global__ void gelu_grad_##SUFFIX(T *out, const T *g, const T *z,         \
                                               size_t n) {                              \
    T zero{};                                                                           \
    EACH(n) store(&out[i], mul(load(g[i]), round_to(gelu_grad<F>(load(z[i])), zero)));  \
  }

ACTIVATION_GRAD(f32, float, float)
ACTIVATION_GRAD(f64, double, double)
ACTIVATION_GRAD(f16, __half, float)
ACTIVATION_GRAD(bf16, __nv_bfloat16, float)
