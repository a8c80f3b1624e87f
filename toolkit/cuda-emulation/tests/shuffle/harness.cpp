// Warp shuffles under emulate.h: each thread of one block of BLOCK threads
// (argument 1) prints, in thread order, a full butterfly sum over its warp,
// the sum over its group of 4 lanes, and the value `__shfl_xor_sync` gives
// it from lane `lane ^ 4` with width 4 (a later group: its own), and the
// value from lane mask 33 (its low 5 bits, 1, as on the card). With
// `split` (argument 2) the even lanes and the odd ones shuffle at two
// different calls, as many times each; with `width` a shuffle of width 3.
#include "emulate.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {
int warp_sum[256], group_sum[256], crossed[256], wrapped[256];

__global__ void shuffles() {
  const int t = threadIdx.x;
  int all = t, four = t;
  for (int m = 16; m > 0; m /= 2) all += __shfl_xor_sync(0xffffffffu, all, m);
  for (int m = 2; m > 0; m /= 2) four += __shfl_xor_sync(0xffffffffu, four, m);
  warp_sum[t] = all;
  group_sum[t] = four;
  crossed[t] = __shfl_xor_sync(0xffffffffu, t * 10, 4, 4);
  wrapped[t] = __shfl_xor_sync(0xffffffffu, t, 33);
}

__global__ void split_sites() {
  const int t = threadIdx.x;
  if (t % 2 == 0) {
    warp_sum[t] = __shfl_xor_sync(0xffffffffu, t, 1);
  } else {
    warp_sum[t] = __shfl_xor_sync(0xffffffffu, t, 1);
  }
}

__global__ void odd_width() { warp_sum[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1, 3); }
} // namespace

int main(int argc, char **argv) {
  const int block = argc > 1 ? std::atoi(argv[1]) : 64;
  if (block < 1 || block > 256) {
    std::fprintf(stderr, "a block of 1 to 256 threads, not %d\n", block);
    return 2;
  }
  const char *mode = argc > 2 ? argv[2] : "";
  const dim3 grid{1, 1, 1}, threads{(unsigned)block, 1, 1};
  if (std::strcmp(mode, "split") == 0) {
    launch(split_sites, grid, threads);
    return 0;
  }
  if (std::strcmp(mode, "width") == 0) {
    launch(odd_width, grid, threads);
    return 0;
  }
  launch(shuffles, grid, threads);
  for (int t = 0; t < block; ++t) {
    std::printf("%d %d %d %d\n", warp_sum[t], group_sum[t], crossed[t], wrapped[t]);
  }
}
