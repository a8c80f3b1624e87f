// The command line of an element-wise kernel's harness:
//
//   HARNESS KERNEL BLOCKS THREADS N INPUT
//
// the kernel's name, a one-dimensional grid, the tensors' length and the
// file of their values (values.h). Exits with the usage where it is wrong.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

#include "emulate.h"

struct ElementwiseArgs {
  std::string kernel;
  dim3 grid, block;
  size_t n;
  std::FILE *input;
};

inline ElementwiseArgs elementwise_args(int argc, char **argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s KERNEL BLOCKS THREADS N INPUT\n", argv[0]);
    std::exit(2);
  }
  ElementwiseArgs a{argv[1],
                    dim3{(unsigned)std::atoi(argv[2]), 1, 1},
                    dim3{(unsigned)std::atoi(argv[3]), 1, 1},
                    std::strtoull(argv[4], nullptr, 10),
                    std::fopen(argv[5], "rb")};
  if (!a.input) {
    std::fprintf(stderr, "cannot open %s\n", argv[5]);
    std::exit(2);
  }
  return a;
}
