// CUDA's __nv_bfloat16 for the CPU emulation (emulate.h): an f32's upper 16
// bits, rounded to nearest even as __float2bfloat16_rn does.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
  std::uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  std::uint32_t u = static_cast<std::uint32_t>(b.bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  if (std::isnan(x)) return __nv_bfloat16{0x7fc0};
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fff + ((u >> 16) & 1);
  return __nv_bfloat16{static_cast<std::uint16_t>(u >> 16)};
}
