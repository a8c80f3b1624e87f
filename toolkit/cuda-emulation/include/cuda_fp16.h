// CUDA's __half for the CPU emulation (emulate.h): IEEE binary16, converted
// with round-to-nearest-even as __float2half_rn does.
#pragma once
#include <bit>
#include <cmath>
struct __half {
  _Float16 value;
};
inline float __half2float(__half h) { return static_cast<float>(h.value); }
inline __half __float2half_rn(float x) { return __half{static_cast<_Float16>(x)}; }
inline __half __float2half(float x) { return __float2half_rn(x); }
inline bool __hisnan(__half h) { return h.value != h.value; }
inline unsigned short __half_as_ushort(__half h) { return std::bit_cast<unsigned short>(h); }
inline __half __ushort_as_half(unsigned short x) { return std::bit_cast<__half>(x); }
// The larger (smaller) of two, +0 above -0, a NaN where either is one.
// Compiled for candle's headers, run by none of the kernels tested here.
inline bool emulated_below(__half a, __half b) {
  return a.value < b.value || (a.value == 0 && b.value == 0 && std::signbit((float)a.value) &&
                               !std::signbit((float)b.value));
}
inline __half __hmax_nan(__half a, __half b) {
  return __hisnan(a) || __hisnan(b) ? __half{a.value + b.value} : (emulated_below(a, b) ? b : a);
}
inline __half __hmin_nan(__half a, __half b) {
  return __hisnan(a) || __hisnan(b) ? __half{a.value + b.value} : (emulated_below(b, a) ? b : a);
}
