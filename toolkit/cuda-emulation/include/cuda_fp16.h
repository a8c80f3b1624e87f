// CUDA's __half for the CPU emulation (emulate.h): IEEE binary16, its
// arithmetic as emulated_half.h describes.
#pragma once
#include "emulated_half.h"

// A __half's bits, as CUDA's headers pass them between the half types.
struct __half_raw {
  unsigned short x;
};

struct __half {
  unsigned short bits;
  __half() = default;
  __half(float f) : bits(std::bit_cast<unsigned short>(static_cast<_Float16>(f))) {}
  // Rounded once from the double (the compiler's conversion), as
  // __double2half.
  __half(double d) : bits(std::bit_cast<unsigned short>(static_cast<_Float16>(d))) {}
  // Through a double: exact up to 2^53, past any index a kernel converts.
  template <std::integral I> __half(I i) : __half(static_cast<double>(i)) {}
  __half(__half_raw r) : bits(r.x) {}
  operator float() const { return static_cast<float>(std::bit_cast<_Float16>(bits)); }
  operator __half_raw() const { return __half_raw{bits}; }
};
EMULATED_HALF_TYPE(__half)

inline float __half2float(__half h) { return h; }
inline __half __float2half_rn(float x) { return __half(x); }
inline __half __float2half(float x) { return __half(x); }
inline __half __double2half(double x) { return __half(x); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __half __ushort_as_half(unsigned short x) { return emulated_from_bits<__half>(x); }
