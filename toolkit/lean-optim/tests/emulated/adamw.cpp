// Runs AdamW's CUDA kernels (kernels/adamw.cu) on the CPU through
// emulate.h (candle-toolkit-cuda-emulation).
//
//   adamw KERNEL BLOCKS THREADS N INPUT
//
// KERNEL: adamw_{moment1,moment2,theta}_{f32,f64,f16,bf16}. INPUT: five f64
// constants (a and b for a moment, the update's five for theta), then the
// tensors as f64 (each value exact in the element type): the state and the
// gradient for a moment, the parameter and both moments for theta. Writes
// the updated tensor to standard output as f64.
#include "elementwise.h"
#include "values.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "../../kernels/adamw.cu"

namespace {

template <typename T>
int run(const std::string &kernel, dim3 grid, dim3 block, size_t n, std::FILE *in,
        void (*m1)(T *, const T *, size_t, double, double),
        void (*m2)(T *, const T *, size_t, double, double),
        void (*th)(T *, const T *, const T *, size_t, double, double, double, double, double)) {
  double k[5];
  if (std::fread(k, sizeof k[0], 5, in) != 5) {
    std::fprintf(stderr, "input has no constants\n");
    return 2;
  }
  std::vector<T> dst = read_values<T>(in, n);
  if (kernel.find("theta") != std::string::npos) {
    std::vector<T> m = read_values<T>(in, n), v = read_values<T>(in, n);
    launch(th, grid, block, dst.data(), m.data(), v.data(), n, k[0], k[1], k[2], k[3], k[4]);
  } else {
    std::vector<T> g = read_values<T>(in, n);
    auto f = kernel.find("moment1") != std::string::npos ? m1 : m2;
    launch(f, grid, block, dst.data(), g.data(), n, k[0], k[1]);
  }
  write_values(stdout, dst);
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  const ElementwiseArgs a = elementwise_args(argc, argv);
  const std::string suffix = a.kernel.substr(a.kernel.rfind('_') + 1);
#define TYPE(SUFFIX, T)                                                                       \
  if (suffix == #SUFFIX)                                                                      \
    return run<T>(a.kernel, a.grid, a.block, a.n, a.input, adamw_moment1_##SUFFIX,            \
                  adamw_moment2_##SUFFIX, adamw_theta_##SUFFIX);
  TYPE(f32, float)
  TYPE(f64, double)
  TYPE(f16, __half)
  TYPE(bf16, __nv_bfloat16)
  std::fprintf(stderr, "no kernel is named %s\n", a.kernel.c_str());
  return 2;
}
