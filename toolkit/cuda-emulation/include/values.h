// Tensors in and out of an emulated kernel's harness: every element as an
// f64, which holds each value of f32, f16 and bf16 exactly.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

// `x` (exact in T, or rounded to nearest even) as a T: a half type rounds
// once from the double, as __double2half and __double2bfloat16.
template <typename T> T from_f64(double x) { return T(x); }

// Exact: a half type converts to float, and float to double, exactly.
template <typename T> double to_f64(T x) { return static_cast<double>(x); }

// `n` f64s from `f`, as T; exits with a message where the input ends.
template <typename T> std::vector<T> read_values(std::FILE *f, size_t n) {
  std::vector<T> v(n);
  for (auto &x : v) {
    double d;
    if (std::fread(&d, sizeof d, 1, f) != 1) {
      std::fprintf(stderr, "the input ends early\n");
      std::exit(2);
    }
    x = from_f64<T>(d);
  }
  return v;
}

// Every element to `f` as an f64.
template <typename T> void write_values(std::FILE *f, const std::vector<T> &v) {
  for (const T &x : v) {
    const double d = to_f64(x);
    std::fwrite(&d, sizeof d, 1, f);
  }
}
