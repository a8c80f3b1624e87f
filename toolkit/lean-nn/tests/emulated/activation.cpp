// Runs the lean layers' activation-gradient kernels (kernels/activation.cu)
// on the CPU through emulate.h (candle-toolkit-cuda-emulation).
//
//   activation KERNEL BLOCKS THREADS N INPUT
//
// KERNEL: {relu,gelu}_grad_{f32,f64,f16,bf16}. INPUT: the gradient and the
// saved tensor (a ReLU's output, GELU's input) as f64, each value exact in
// the element type. Writes `g * act'(saved)` to standard output as f64.
#include "elementwise.h"
#include "values.h"

#include "../../kernels/activation.cu"

namespace {

template <typename T>
int run(void (*kernel)(T *, const T *, const T *, size_t), dim3 grid, dim3 block, size_t n,
        std::FILE *in) {
  std::vector<T> g = read_values<T>(in, n), saved = read_values<T>(in, n), out(n);
  launch(kernel, grid, block, out.data(), g.data(), saved.data(), n);
  write_values(stdout, out);
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  const ElementwiseArgs a = elementwise_args(argc, argv);
#define KERNEL(NAME)                                                                      \
  if (a.kernel == #NAME) return run(NAME, a.grid, a.block, a.n, a.input);
#define TYPES(ACT)                                                                        \
  KERNEL(ACT##_grad_f32) KERNEL(ACT##_grad_f64) KERNEL(ACT##_grad_f16) KERNEL(ACT##_grad_bf16)
  TYPES(relu)
  TYPES(gelu)
  std::fprintf(stderr, "no kernel is named %s\n", a.kernel.c_str());
  return 2;
}
