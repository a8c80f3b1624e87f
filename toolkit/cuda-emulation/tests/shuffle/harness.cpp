// Warp shuffles under emulate.h: each thread of one block of BLOCK threads
// (argument 1) prints, in thread order, a full butterfly sum over its warp,
// the sum over its group of 4 lanes, and the value `__shfl_xor_sync` gives
// it from lane `lane ^ 4` with width 4 (a later group: its own).
#include "emulate.h"

#include <cstdio>
#include <cstdlib>

namespace {
int warp_sum[256], group_sum[256], crossed[256];

__global__ void shuffles() {
  const int t = threadIdx.x;
  int all = t, four = t;
  for (int m = 16; m > 0; m /= 2) all += __shfl_xor_sync(0xffffffffu, all, m);
  for (int m = 2; m > 0; m /= 2) four += __shfl_xor_sync(0xffffffffu, four, m);
  warp_sum[t] = all;
  group_sum[t] = four;
  crossed[t] = __shfl_xor_sync(0xffffffffu, t * 10, 4, 4);
}
} // namespace

int main(int argc, char **argv) {
  const int block = argc > 1 ? std::atoi(argv[1]) : 64;
  if (block < 1 || block > 256) {
    std::fprintf(stderr, "a block of 1 to 256 threads, not %d\n", block);
    return 2;
  }
  launch(shuffles, dim3{1, 1, 1}, dim3{(unsigned)block, 1, 1});
  for (int t = 0; t < block; ++t) std::printf("%d %d %d\n", warp_sum[t], group_sum[t], crossed[t]);
}
