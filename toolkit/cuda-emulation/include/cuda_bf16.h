// CUDA's __nv_bfloat16 for the CPU emulation (emulate.h): an f32's upper
// 16 bits, its arithmetic as emulated_half.h describes.
#pragma once
#include "emulated_half.h"

struct __nv_bfloat16 {
  std::uint16_t bits;
  __nv_bfloat16() = default;
  // Rounded to nearest even on the 16 bits dropped, as
  // __float2bfloat16_rn; a NaN is 0x7fff.
  __nv_bfloat16(float f) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    bits = std::isnan(f) ? 0x7fff
                         : static_cast<std::uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  // Rounded once from the double, as __double2bfloat16: 8 significant
  // bits, f32's exponents.
  __nv_bfloat16(double d) : __nv_bfloat16(static_cast<float>(emulated_round(d, 8, -126, 128))) {}
  // Through a double: exact up to 2^53, past any index a kernel converts.
  template <std::integral I> __nv_bfloat16(I i) : __nv_bfloat16(static_cast<double>(i)) {}
  operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
};
EMULATED_HALF_TYPE(__nv_bfloat16)

inline float __bfloat162float(__nv_bfloat16 b) { return b; }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __nv_bfloat16(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16(x); }
inline __nv_bfloat16 __double2bfloat16(double x) { return __nv_bfloat16(x); }

// Two of them, as the vectorised kernels load them, and the lane-wise
// operations on a pair (each lane rounded on its own, as __hadd2 and
// __hmul2).
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162{a.x + b.x, a.y + b.y};
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162{a.x * b.x, a.y * b.y};
}
