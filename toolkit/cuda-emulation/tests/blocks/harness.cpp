// A block of any shape: each thread writes the grid's and the block's
// dimensions, its indices and the sum of its warp's ranks (x fastest) by a
// butterfly, one line per thread.
//
//   harness GRID_X GRID_Y GRID_Z BLOCK_X BLOCK_Y BLOCK_Z
#include "emulate.h"

__global__ void where(unsigned *out) {
  const unsigned rank = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned sum = rank;
  for (int mask = 16; mask > 0; mask >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  unsigned *o = out + 14 * (block * blockDim.x * blockDim.y * blockDim.z + rank);
  const unsigned values[14] = {gridDim.x,  gridDim.y,   gridDim.z,   blockDim.x, blockDim.y,
                               blockDim.z, blockIdx.x,  blockIdx.y,  blockIdx.z, threadIdx.x,
                               threadIdx.y, threadIdx.z, rank,       sum};
  for (int i = 0; i < 14; ++i) o[i] = values[i];
}

int main(int argc, char **argv) {
  if (argc != 7) return 2;
  unsigned d[6];
  for (int i = 0; i < 6; ++i) d[i] = std::atoi(argv[i + 1]);
  const dim3 grid{d[0], d[1], d[2]}, block{d[3], d[4], d[5]};
  std::vector<unsigned> out(14 * d[0] * d[1] * d[2] * d[3] * d[4] * d[5]);
  launch(where, grid, block, out.data());
  for (size_t t = 0; t < out.size(); t += 14) {
    for (int i = 0; i < 14; ++i) std::printf(i ? " %u" : "%u", out[t + i]);
    std::printf("\n");
  }
}
