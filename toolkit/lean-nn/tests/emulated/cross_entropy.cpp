// Runs the cross-entropy's kernels (kernels/cross_entropy.cu) on the CPU
// through emulate.h (candle-toolkit-cuda-emulation).
//
//   cross_entropy KERNEL BLOCKS THREADS ROWS CLASSES SCALE INPUT
//
// KERNEL: cross_entropy_{loss,grad}_{f32,f64,f16,bf16}. INPUT: the logits
// (ROWS by CLASSES, each exact in the element type), then the ROWS targets,
// as f64. Writes each row's loss, or the gradient times SCALE, to standard
// output as f64.
#include <string>

#include "emulate.h"
#include "values.h"

#include "../../kernels/cross_entropy.cu"

namespace {

struct Args {
  dim3 grid, block;
  size_t rows, classes;
  double scale;
  std::FILE *input;
};

template <typename T>
std::vector<T> logits(const Args &a, std::vector<unsigned int> &targets) {
  std::vector<T> z = read_values<T>(a.input, a.rows * a.classes);
  targets = read_values<unsigned int>(a.input, a.rows);
  return z;
}

template <typename T>
int loss(void (*kernel)(double *, const T *, const unsigned int *, size_t, size_t),
         const Args &a) {
  std::vector<unsigned int> t;
  const std::vector<T> z = logits<T>(a, t);
  std::vector<double> out(a.rows);
  launch(kernel, a.grid, a.block, out.data(), z.data(), t.data(), a.rows, a.classes);
  write_values(stdout, out);
  return 0;
}

template <typename T>
int grad(void (*kernel)(T *, const T *, const unsigned int *, size_t, size_t, double),
         const Args &a) {
  std::vector<unsigned int> t;
  const std::vector<T> z = logits<T>(a, t);
  std::vector<T> out(z.size());
  launch(kernel, a.grid, a.block, out.data(), z.data(), t.data(), a.rows, a.classes, a.scale);
  write_values(stdout, out);
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s KERNEL BLOCKS THREADS ROWS CLASSES SCALE INPUT\n", argv[0]);
    return 2;
  }
  const std::string kernel = argv[1];
  const Args a{dim3{(unsigned)std::atoi(argv[2]), 1, 1},
               dim3{(unsigned)std::atoi(argv[3]), 1, 1},
               std::strtoull(argv[4], nullptr, 10),
               std::strtoull(argv[5], nullptr, 10),
               std::strtod(argv[6], nullptr),
               std::fopen(argv[7], "rb")};
  if (!a.input) {
    std::fprintf(stderr, "cannot open %s\n", argv[7]);
    return 2;
  }
#define KERNELS(SUFFIX)                                                                   \
  if (kernel == "cross_entropy_loss_" #SUFFIX) return loss(cross_entropy_loss_##SUFFIX, a); \
  if (kernel == "cross_entropy_grad_" #SUFFIX) return grad(cross_entropy_grad_##SUFFIX, a);
  KERNELS(f32)
  KERNELS(f64)
  KERNELS(f16)
  KERNELS(bf16)
  std::fprintf(stderr, "no kernel is named %s\n", kernel.c_str());
  return 2;
}
