// What the emulation's __half and __nv_bfloat16 share (cuda_fp16.h,
// cuda_bf16.h): each holds its bits, converts to float exactly and from
// float, double and the integers with round-to-nearest-even, and computes
// each operation in float, rounded once to the type. float's 24 bits are
// at least twice the types' 11 and 8 plus 2, so rounding float's
// correctly rounded sum, difference, product, quotient or square root to
// the type gives the type's own correctly rounded result (among bf16's
// subnormals, whose exponents float shares, tests/halves.rs checks it):
// what the card's __hadd, __hsub, __hmul and __hdiv give from compute
// capability 5.3 (__half) and 8.0 (__nv_bfloat16) on. hsqrt, hexp, hlog,
// hsin and hcos are the host's functions rounded once; the card's are
// approximations of their own. A NaN keeps its payload here, where the
// card's arithmetic gives its canonical one.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>

// The value of the type with `digits` significant bits, exponents from
// `min_exp` on (that of its smallest normal value) and `max_exp` below
// (that of its infinity) nearest to `x`, ties to even, as a double (a NaN
// or an infinity as it is): rounded once, as CUDA's __double2half and
// __double2bfloat16 round, where a round trip through float would round
// twice.
inline double emulated_round(double x, int digits, int min_exp, int max_exp) {
  if (!std::isfinite(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);
  // x lies in [2^(e-1), 2^e): the type's spacing there, or below its
  // smallest normal, that of its subnormals.
  const double spacing = std::ldexp(1.0, std::max(e - 1, min_exp) - (digits - 1));
  const double r = std::nearbyint(x / spacing) * spacing;
  return std::fabs(r) >= std::ldexp(1.0, max_exp) ? std::copysign(INFINITY, x) : r;
}

// A half type's value with the bits `bits`.
template <typename T> T emulated_from_bits(unsigned bits) {
  return std::bit_cast<T>(static_cast<std::uint16_t>(bits));
}

#define EMULATED_HALF_TYPE(T)                                                                  \
  inline T operator+(T a, T b) { return T(float(a) + float(b)); }                              \
  inline T operator-(T a, T b) { return T(float(a) - float(b)); }                              \
  inline T operator*(T a, T b) { return T(float(a) * float(b)); }                              \
  inline T operator/(T a, T b) { return T(float(a) / float(b)); }                              \
  inline T operator+(T a) { return a; }                                                        \
  /* As __hneg: the sign bit flipped, a NaN's too. */                                          \
  inline T operator-(T a) { return emulated_from_bits<T>(a.bits ^ 0x8000u); }                  \
  inline T &operator+=(T &a, T b) { return a = a + b; }                                        \
  inline T &operator-=(T &a, T b) { return a = a - b; }                                        \
  inline T &operator*=(T &a, T b) { return a = a * b; }                                        \
  inline T &operator/=(T &a, T b) { return a = a / b; }                                        \
  inline bool operator==(T a, T b) { return float(a) == float(b); }                            \
  inline bool operator!=(T a, T b) { return float(a) != float(b); }                            \
  inline bool operator<(T a, T b) { return float(a) < float(b); }                              \
  inline bool operator<=(T a, T b) { return float(a) <= float(b); }                            \
  inline bool operator>(T a, T b) { return float(a) > float(b); }                              \
  inline bool operator>=(T a, T b) { return float(a) >= float(b); }                            \
  inline bool __hisnan(T a) { return std::isnan(float(a)); }                                   \
  inline T __habs(T a) { return emulated_from_bits<T>(a.bits & 0x7fffu); }                     \
  inline T hsqrt(T a) { return T(std::sqrt(float(a))); }                                       \
  inline T hexp(T a) { return T(std::exp(float(a))); }                                         \
  inline T hlog(T a) { return T(std::log(float(a))); }                                         \
  inline T hsin(T a) { return T(std::sin(float(a))); }                                         \
  inline T hcos(T a) { return T(std::cos(float(a))); }                                         \
  /* The larger (smaller) of two, +0 above -0, a NaN where either is one. */                   \
  inline bool emulated_below(T a, T b) {                                                       \
    return a < b || (a == b && std::signbit(float(a)) && !std::signbit(float(b)));             \
  }                                                                                            \
  inline T __hmax_nan(T a, T b) {                                                              \
    return __hisnan(a) || __hisnan(b) ? a + b : (emulated_below(a, b) ? b : a);                \
  }                                                                                            \
  inline T __hmin_nan(T a, T b) {                                                              \
    return __hisnan(a) || __hisnan(b) ? a + b : (emulated_below(b, a) ? b : a);                \
  }
