// Races between a block's threads, for a race-checked build of emulate.h.
// One block of 64 threads over a shared tile: each thread writes its own
// element, then reads its neighbour's. With MODE (argument 1) `barrier`,
// a __syncthreads comes between (no race), and every thread prints what it
// read; `none` leaves the barrier out (a race on the tile); `same` has
// every thread of a warp write one element of the output (a race on global
// memory) after the barrier.
#include "emulate.h"

#include <cstdio>
#include <cstring>

namespace {
constexpr int THREADS = 64;
int out[THREADS];

template <bool SYNC, bool SAME> __global__ void neighbours(int *dst) {
  __shared__ int tile[THREADS];
  const int t = threadIdx.x;
  tile[t] = 3 * t + 1;
  if (SYNC) __syncthreads();
  const int read = tile[(t + 1) % THREADS];
  dst[SAME ? t / 32 : t] = read;
}
} // namespace

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  const dim3 grid{2, 1, 1}, block{THREADS, 1, 1};
  if (std::strcmp(mode, "barrier") == 0) {
    launch(neighbours<true, false>, grid, block, out);
  } else if (std::strcmp(mode, "none") == 0) {
    launch(neighbours<false, false>, grid, block, out);
  } else if (std::strcmp(mode, "same") == 0) {
    launch(neighbours<true, true>, grid, block, out);
  } else {
    std::fprintf(stderr, "usage: harness barrier|none|same\n");
    return 2;
  }
  for (int t = 0; t < THREADS; ++t) std::printf("%d\n", out[t]);
}
