// CUDA's 8-bit float e4m3, declared so that candle's kernels compile for
// compute capability 8.0 and later, where they define kernels over it. No
// test runs one: a conversion to or from it stops the harness.
#pragma once
#include <cstdio>
#include <cstdlib>

#include "cuda_fp16.h"

[[noreturn]] inline void emulated_fp8(const char *what) {
  std::fprintf(stderr, "%s: CUDA's 8-bit floats are not emulated\n", what);
  std::abort();
}

enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
typedef unsigned char __nv_fp8_storage_t;

struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
  __nv_fp8_e4m3() = default;
  template <typename X> explicit __nv_fp8_e4m3(X) { emulated_fp8("__nv_fp8_e4m3"); }
};

inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t, __nv_fp8_interpretation_t) {
  emulated_fp8("__nv_cvt_fp8_to_halfraw");
}
