// Tensors in and out of an emulated kernel's harness: every element as an
// f64, which holds each value of f32, f16 and bf16 exactly.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

// `x` (exact in T, or rounded to nearest even) as a T.
template <typename T> T from_f64(double x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(x);
  } else {
    // Rounded once from the double, as __double2half and __double2bfloat16.
    return T(x);
  }
}

template <typename T> double to_f64(T x) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(x);
  }
}

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
