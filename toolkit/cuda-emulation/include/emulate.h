// Just enough of CUDA to run the toolkit's kernels on a CPU, so that their
// arithmetic, indexing, masking and launch grids are tested where there is
// no GPU: each block's threads are real threads, released together at
// every __syncthreads by a std::barrier, and blocks run one after the other
// (so a block's __shared__ arrays can be function statics). The rounded
// intrinsics are C++'s own float and double operations, IEEE's, each
// rounded on its own (compiled with -ffp-contract=off, so nothing fuses).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<> *emulated_barrier = nullptr;
inline void __syncthreads() { emulated_barrier->arrive_and_wait(); }
using std::max;
using std::min;

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

// `kernel<<<grid, block>>>(args...)`, one block at a time.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  gridDim = grid;
  blockDim = block;
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> barrier(block.x);
      emulated_barrier = &barrier;
      std::vector<std::thread> threads;
      for (unsigned tx = 0; tx < block.x; ++tx) {
        threads.emplace_back([=] {
          blockIdx = dim3{bx, by, 1};
          threadIdx = dim3{tx, 0, 0};
          kernel(args...);
        });
      }
      for (auto &t : threads) t.join();
    }
  }
}
