// AdamW's update in place on a GPU: the arithmetic of the CPU kernel
// (src/kernel.rs) and of candle_nn::AdamW's composed operations, in the same
// order and with the same roundings. Each product and sum is rounded on its
// own (the _rn intrinsics), as candle's separate kernels round them, so that
// nvcc cannot fuse them into one multiply-add. Half types compute in f32.
#include "candle_kernel_params/elements.cuh"

// `x * c + 0`: candle's multiplication by a scalar cast to the element type.
__device__ __forceinline__ float scal(float x, double c) {
  return __fadd_rn(__fmul_rn(x, (float)c), 0.0f);
}
__device__ __forceinline__ double scal(double x, double c) {
  return __dadd_rn(__dmul_rn(x, c), 0.0);
}

__device__ __forceinline__ float moment1(float m, float g, double a, double b) {
  return __fadd_rn(scal(m, a), scal(g, b));
}
__device__ __forceinline__ double moment1(double m, double g, double a, double b) {
  return __dadd_rn(scal(m, a), scal(g, b));
}
__device__ __forceinline__ float moment2(float v, float g, double a, double b) {
  return __fadd_rn(scal(v, a), scal(__fmul_rn(g, g), b));
}
__device__ __forceinline__ double moment2(double v, double g, double a, double b) {
  return __dadd_rn(scal(v, a), scal(__dmul_rn(g, g), b));
}

__device__ __forceinline__ float theta(float t, float m, float v, double scale_m,
                                       double scale_v, double decay, double lr,
                                       double eps) {
  float m_hat = scal(m, scale_m);
  float v_hat = scal(v, scale_v);
  // `+ eps` is candle's affine(1, eps).
  float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v_hat), 1.0f), (float)eps);
  return __fsub_rn(scal(t, decay), scal(__fdiv_rn(m_hat, denom), lr));
}
__device__ __forceinline__ double theta(double t, double m, double v, double scale_m,
                                        double scale_v, double decay, double lr,
                                        double eps) {
  double m_hat = scal(m, scale_m);
  double v_hat = scal(v, scale_v);
  double denom = __dadd_rn(__dmul_rn(__dsqrt_rn(v_hat), 1.0), eps);
  return __dsub_rn(scal(t, decay), scal(__ddiv_rn(m_hat, denom), lr));
}

#define EACH(n) \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)

#define ADAMW(SUFFIX, T)                                                              \
  extern "C" __global__ void adamw_moment1_##SUFFIX(T *m, const T *g, size_t n,       \
                                                    double a, double b) {             \
    EACH(n) store(&m[i], moment1(load(m[i]), load(g[i]), a, b));                      \
  }                                                                                   \
  extern "C" __global__ void adamw_moment2_##SUFFIX(T *v, const T *g, size_t n,       \
                                                    double a, double b) {             \
    EACH(n) store(&v[i], moment2(load(v[i]), load(g[i]), a, b));                      \
  }                                                                                   \
  extern "C" __global__ void adamw_theta_##SUFFIX(                                    \
      T *t, const T *m, const T *v, size_t n, double scale_m, double scale_v,         \
      double decay, double lr, double eps) {                                          \
    EACH(n) store(&t[i], theta(load(t[i]), load(m[i]), load(v[i]), scale_m, scale_v, \
                              decay, lr, eps));                                       \
  }

ADAMW(f32, float)
ADAMW(f64, double)
ADAMW(f16, __half)
ADAMW(bf16, __nv_bfloat16)
