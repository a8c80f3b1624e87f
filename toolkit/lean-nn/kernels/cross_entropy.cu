// The cross-entropy of rows of logits on a GPU, a block per row: its loss
// (`logsumexp(z) - z[target]`) and its gradient
// (`(softmax(z) - onehot(target)) * scale`), each from the row's maximum and
// its sum of exponentials, without a tensor the logits' size beside them.
// candle's composed operations make several: the logits widened to f32,
// shifted, exponentiated, normalised.
//
// The arithmetic is the CPU row kernels' (src/cpu.rs), in f32 for f32, f16
// and bf16 logits, and in f64 for f64 ones (which the CPU leaves to candle's
// operations). The maximum skips NaN (fmax, as Rust's `max`), which then
// shows in the sum. The last steps are rounded one by one (candle-kernel-
// params' elements.cuh), as on the CPU. The sums are a block's reduction, in
// another order than the CPU's lanes: the values agree to rounding, not to
// the bit.
#include "candle_kernel_params/elements.cuh"

__device__ __forceinline__ float ex(float x) { return expf(x); }
__device__ __forceinline__ double ex(double x) { return exp(x); }
__device__ __forceinline__ float ln(float x) { return logf(x); }
__device__ __forceinline__ double ln(double x) { return log(x); }

struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
};
struct Sum {
  template <typename F> __device__ __forceinline__ F operator()(F a, F b) const { return a + b; }
};

// Every thread's `x` reduced by `op` over the block (whose size is a
// multiple of 32, at most 1024: the launch's), each warp's by shuffles,
// then the warps' partials in order, so every thread returns the same
// value. `warps` is the block's shared scratch of 32.
template <typename F, typename Op>
__device__ F block_reduce(F x, Op op, F *warps) {
  for (int m = 16; m > 0; m /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, m));
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = x;
  __syncthreads();
  x = warps[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w) x = op(x, warps[w]);
  __syncthreads(); // every thread has read the partials before the next use
  return x;
}

// The maximum of the row `z` of `n` and the sum of `exp(z - max)`.
template <typename F, typename T>
__device__ void row_stats(const T *z, size_t n, F *warps, F &max, F &sum) {
  F m = -INFINITY;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) m = Max{}(m, (F)load(z[i]));
  max = block_reduce(m, Max{}, warps);
  F s = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) s = add(s, ex(sub((F)load(z[i]), max)));
  sum = block_reduce(s, Sum{}, warps);
}

// `loss[r] = logsumexp(z_r) - z_r[targets[r]]` for each of `rows` rows of
// `classes` logits. The targets are class indices, checked by the caller.
template <typename F, typename T>
__device__ void rows_loss(double *loss, const T *logits, const unsigned int *targets, size_t rows,
                          size_t classes, F *warps) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *z = logits + r * classes;
    F max, sum;
    row_stats(z, classes, warps, max, sum);
    if (threadIdx.x == 0) loss[r] = sub(add(max, ln(sum)), (F)load(z[targets[r]]));
  }
}

// `out_r = (softmax(z_r) - onehot(targets[r])) * scale` for each row, in
// the CPU's steps: `exp(z - max) * (scale / sum)`, less `scale` at the
// target, rounded to the element type.
template <typename F, typename T>
__device__ void rows_grad(T *out, const T *logits, const unsigned int *targets, size_t rows,
                          size_t classes, double scale, F *warps) {
  const F s = (F)scale;
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *z = logits + r * classes;
    T *d = out + r * classes;
    F max, sum;
    row_stats(z, classes, warps, max, sum);
    const F k = s / sum;
    const size_t t = targets[r];
    for (size_t i = threadIdx.x; i < classes; i += blockDim.x) {
      F p = mul(ex(sub((F)load(z[i]), max)), k);
      if (i == t) p = sub(p, s);
      store(&d[i], p);
    }
  }
}

#define CROSS_ENTROPY(SUFFIX, T, F)                                                        \
  extern "C" __global__ void cross_entropy_loss_##SUFFIX(                                  \
      double *loss, const T *logits, const unsigned int *targets, size_t rows,             \
      size_t classes) {                                                                    \
    __shared__ F warps[32];                                                                \
    rows_loss<F>(loss, logits, targets, rows, classes, warps);                             \
  }                                                                                        \
  extern "C" __global__ void cross_entropy_grad_##SUFFIX(                                  \
      T *out, const T *logits, const unsigned int *targets, size_t rows, size_t classes,   \
      double scale) {                                                                      \
    __shared__ F warps[32];                                                                \
    rows_grad<F>(out, logits, targets, rows, classes, scale, warps);                       \
  }

CROSS_ENTROPY(f32, float, float)
CROSS_ENTROPY(f64, double, double)
CROSS_ENTROPY(f16, __half, float)
CROSS_ENTROPY(bf16, __nv_bfloat16, float)
