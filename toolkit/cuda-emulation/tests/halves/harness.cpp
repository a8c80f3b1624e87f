// The emulation's __half and __nv_bfloat16, one operation at a time:
//
//   HARNESS TYPE N INPUT
//
// TYPE is f16 or bf16; INPUT holds N pairs (a, b) of f64s (values.h). For
// each pair, with x and y the type's values nearest a and b, writes as
// f64s: x, the type's value nearest a as a float, x + y, x - y, x * y,
// x / y, hsqrt(x), -x, __habs(x), __hmax_nan(x, y), __hmin_nan(x, y); the
// lanes of __hadd2 and __hmul2 of (x, y) and (y, y) for bf16 (for f16, the
// same sums and products); the type's value nearest a truncated to an int
// (clamped to 2e9); then x < y, x <= y, x > y, x >= y, x == y and x != y.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "emulate.h"
#include "values.h"

template <typename T> void each(std::FILE *in, size_t n) {
  std::vector<double> out;
  for (size_t i = 0; i < n; ++i) {
    double ab[2];
    if (std::fread(ab, sizeof ab[0], 2, in) != 2) {
      std::fprintf(stderr, "the input ends early\n");
      std::exit(2);
    }
    const T x(ab[0]), y(ab[1]);
    const T results[] = {x,         T(static_cast<float>(ab[0])),
                         x + y,     x - y,
                         x * y,     x / y,
                         hsqrt(x),  -x,
                         __habs(x), __hmax_nan(x, y),
                         __hmin_nan(x, y)};
    for (T r : results) out.push_back(static_cast<float>(r));
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 xy{x, y}, yy{y, y}, sum = __hadd2(xy, yy), product = __hmul2(xy, yy);
      for (T r : {sum.x, sum.y, product.x, product.y}) out.push_back(static_cast<float>(r));
    } else {
      for (T r : {x + y, y + y, x * y, y * y}) out.push_back(static_cast<float>(r));
    }
    const T from_int(static_cast<int>(std::clamp(std::trunc(ab[0]), -2e9, 2e9)));
    out.push_back(static_cast<float>(from_int));
    for (bool b : {x < y, x <= y, x > y, x >= y, x == y, x != y}) out.push_back(b);
  }
  write_values(stdout, out);
}

int main(int argc, char **argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: HARNESS f16|bf16 N INPUT\n");
    return 2;
  }
  std::FILE *in = std::fopen(argv[3], "rb");
  if (!in) {
    std::fprintf(stderr, "cannot open %s\n", argv[3]);
    return 2;
  }
  const std::string type = argv[1];
  const size_t n = std::stoul(argv[2]);
  if (type == "f16") {
    each<__half>(in, n);
  } else if (type == "bf16") {
    each<__nv_bfloat16>(in, n);
  } else {
    std::fprintf(stderr, "a type is f16 or bf16, not %s\n", type.c_str());
    return 2;
  }
}
