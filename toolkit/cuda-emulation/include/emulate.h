// Just enough of CUDA to run the toolkit's kernels on a CPU, so that their
// arithmetic, indexing, masking and launch grids are tested where there is
// no GPU: each block's threads are real threads, released together at
// every __syncthreads by a std::barrier, and blocks run one after the other
// (so a block's __shared__ arrays can be function statics). A warp's
// shuffle meets its 32 threads at a barrier of their own, and each lane
// names the shuffle it reached (its file, line and column), so a kernel
// whose threads of one warp reach different shuffles stops here instead of
// passing (or hangs, where the counts differ). The rounded
// intrinsics are C++'s own float and double operations, IEEE's, each
// rounded on its own (compiled with -ffp-contract=off, so nothing fuses).
// Built with -fsanitize=thread, a race between a block's threads stops the
// run: the barriers order a block's and a warp's threads as on the card,
// and blocks are ordered by the joins between them.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <source_location>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

// CUDA's 16-byte vector, which the kernels load from shared memory, and
// its 8-byte one.
struct __align__(16) float4 {
  float x, y, z, w;
};
struct __align__(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<> *emulated_barrier = nullptr;
inline void __syncthreads() { emulated_barrier->arrive_and_wait(); }

// A thread's place in its block, x fastest: its warp is rank / 32, its lane
// rank % 32, as on the card.
inline unsigned emulated_rank() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// One warp of the block being run: its threads' barrier, the values they
// hand each other in a shuffle and the shuffle each lane reached.
struct EmulatedWarp {
  explicit EmulatedWarp(unsigned size) : size(size), barrier(size) {}
  unsigned size;
  std::barrier<> barrier;
  unsigned char slots[32][8];
  std::source_location sites[32];
};

inline bool same_site(const std::source_location &a, const std::source_location &b) {
  return a.line() == b.line() && a.column() == b.column() &&
         std::strcmp(a.file_name(), b.file_name()) == 0;
}
inline std::vector<std::unique_ptr<EmulatedWarp>> emulated_warps;

// `__shfl_xor_sync(mask, var, lane_mask, width)`: the value of `var` in lane
// `lane ^ lane_mask`, or the caller's own where that lane lies in a later
// group of `width` lanes. As on the card, only lane_mask's low 5 bits count
// (PTX's shfl.sync takes b[4:0]). Every lane of the warp must take part, at
// the same shuffle (the kernels shuffle only with a full mask), and width
// must be a power of 2 up to 32; anything else stops the harness.
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                  std::source_location site = std::source_location::current()) {
  static_assert(sizeof(T) <= 8, "a shuffled value has at most 8 bytes");
  EmulatedWarp &warp = *emulated_warps[emulated_rank() / 32];
  const unsigned lane = emulated_rank() % 32;
  const unsigned full = warp.size == 32 ? 0xffffffffu : (1u << warp.size) - 1;
  if ((mask & full) != full) {
    std::fprintf(stderr, "__shfl_xor_sync with mask %#x leaves out lanes of a warp of %u\n", mask,
                 warp.size);
    std::abort();
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    std::fprintf(stderr, "__shfl_xor_sync at %s:%u with width %d: a power of 2 up to 32\n",
                 site.file_name(), site.line(), width);
    std::abort();
  }
  const unsigned source = lane ^ (static_cast<unsigned>(lane_mask) & 31u);
  std::memcpy(warp.slots[lane], &var, sizeof(T));
  warp.sites[lane] = site;
  warp.barrier.arrive_and_wait();
  const std::source_location &first = warp.sites[0];
  if (!same_site(site, first)) {
    std::fprintf(stderr,
                 "lanes of a warp reach different shuffles: lane %u at %s:%u:%u, lane 0 at "
                 "%s:%u:%u\n",
                 lane, site.file_name(), site.line(), site.column(), first.file_name(),
                 first.line(), first.column());
    std::abort();
  }
  T got = var;
  if (source / width <= lane / width) {
    if (source >= warp.size) {
      std::fprintf(stderr, "__shfl_xor_sync reads lane %u of a warp of %u\n", source, warp.size);
      std::abort();
    }
    std::memcpy(&got, warp.slots[source], sizeof(T));
  }
  // No lane writes its next value before every lane has read this one.
  warp.barrier.arrive_and_wait();
  return got;
}
using std::max;
using std::min;
using std::isnan;
using std::signbit;

// CUDA's reciprocal square root and normal distribution function, with
// the host's rounding (the card's are approximations of their own).
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float normcdff(float x) { return 0.5f * std::erfc(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * std::erfc(-x * 0.70710678118654752); }

// The CUDA release whose headers this stands for where a kernel asks
// (candle's `compatibility.cuh`): 12.4, whose cuda_fp16.h declares
// __hmax_nan and __hmin_nan for every architecture.
#define __CUDACC_VER_MAJOR__ 12
#define __CUDACC_VER_MINOR__ 4

// A value's bits as another type of its size.
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }

// The atomics, each one indivisible read-modify-write returning the old
// value and ordering nothing else, as on the card (relaxed: a kernel that
// needs __threadfence is not emulated). None of candle's kernels that run
// here calls them; they are for its headers to compile.
constexpr auto emulated_relaxed = std::memory_order_relaxed;
template <typename T>
T atomicCAS(T *address, std::type_identity_t<T> compare, std::type_identity_t<T> value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value, emulated_relaxed);
  return compare;
}
template <typename T> T atomicAdd(T *address, std::type_identity_t<T> value) {
  std::atomic_ref<T> a(*address);
  if constexpr (std::is_arithmetic_v<T>) {
    return a.fetch_add(value, emulated_relaxed);
  } else {
    // __half and __nv_bfloat16: the sum, rounded to the type, swapped in.
    T old = a.load(emulated_relaxed);
    while (!a.compare_exchange_weak(old, old + value, emulated_relaxed)) {
    }
    return old;
  }
}
template <typename T> T atomicMin(T *address, std::type_identity_t<T> value) {
  std::atomic_ref<T> a(*address);
  T old = a.load(emulated_relaxed);
  while (value < old && !a.compare_exchange_weak(old, value, emulated_relaxed)) {
  }
  return old;
}
template <typename T> T atomicMax(T *address, std::type_identity_t<T> value) {
  std::atomic_ref<T> a(*address);
  T old = a.load(emulated_relaxed);
  while (value > old && !a.compare_exchange_weak(old, value, emulated_relaxed)) {
  }
  return old;
}

// The intrinsics that round each operation on its own.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

// `kernel<<<grid, block>>>(args...)`, one block at a time. Each argument
// converts to its parameter's type as in a C++ call, where a launch on the
// card reads its bytes as given (candle-kernel-params' tests hold the Rust
// side's arguments to the kernels' declarations).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "one argument for each parameter");
  gridDim = grid;
  blockDim = block;
  const unsigned size = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> barrier(size);
        emulated_barrier = &barrier;
        emulated_warps.clear();
        for (unsigned first = 0; first < size; first += 32) {
          emulated_warps.push_back(std::make_unique<EmulatedWarp>(std::min(32u, size - first)));
        }
        std::vector<std::thread> threads;
        for (unsigned rank = 0; rank < size; ++rank) {
          threads.emplace_back([=] {
            blockIdx = dim3{bx, by, bz};
            threadIdx = dim3{rank % block.x, rank / block.x % block.y, rank / (block.x * block.y)};
            kernel(args...);
          });
        }
        for (auto &t : threads) t.join();
      }
    }
  }
}
