// CUDA's __half for the CPU emulation (emulate.h): IEEE binary16, converted
// with round-to-nearest-even as __float2half_rn does.
#pragma once
struct __half {
  _Float16 value;
};
inline float __half2float(__half h) { return static_cast<float>(h.value); }
inline __half __float2half_rn(float x) { return __half{static_cast<_Float16>(x)}; }
