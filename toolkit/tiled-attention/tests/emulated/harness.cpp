// Runs the tiled attention's CUDA kernels (kernels/flash_*.cu) on the CPU
// through emulate.h (candle-toolkit-cuda-emulation), with the launches
// src/flash_plan.rs gives a GPU.
//
//   harness FORWARD GX GY BLOCK DELTA GX GY BLOCK
//           BACKWARD_KV GX GY BLOCK BACKWARD_Q GX GY BLOCK INPUT
//
// INPUT, as f64 (values.h): batch, q_heads, kv_heads, nq, nk, d, dv,
// causal and the scale; then q, k, v and d_out, each value exact in the
// kernels' element type. Writes out, lse, dq, dk and dv to standard output
// as f64. Outputs start as a poison value, so an element no kernel wrote
// shows.
#include "emulate.h"
#include "values.h"

#include <cstdio>
#include <string>

#include "../../kernels/flash_128.cu"
#include "../../kernels/flash_32.cu"
#include "../../kernels/flash_64.cu"

namespace {

struct Call {
  std::string name;
  dim3 grid, block;
};

const double POISON = 1.0e30;

template <typename T, typename Fwd, typename Delta, typename Kv, typename Q>
int run(std::FILE *in, const Call *calls, Fwd fwd, Delta delta, Kv kv, Q q_kernel) {
  const std::vector<double> h = read_values<double>(in, 9);
  const int b = h[0], hq = h[1], hkv = h[2], nq = h[3], nk = h[4], d = h[5], dv = h[6];
  const int causal = h[7], group = hq / hkv;
  const float scale = static_cast<float>(h[8]);
  const size_t nqd = (size_t)b * hq * nq, nkd = (size_t)b * hkv * nk;
  auto q = read_values<T>(in, nqd * d);
  auto k = read_values<T>(in, nkd * d);
  auto v = read_values<T>(in, nkd * dv);
  auto d_out = read_values<T>(in, nqd * dv);
  const T poison = from_f64<T>(POISON);
  std::vector<T> o(nqd * dv, poison), dq(nqd * d, poison), dk(nkd * d, poison),
      dvv(nkd * dv, poison);
  std::vector<float> lse(nqd, POISON), dl(nqd, POISON);
  launch(fwd, calls[0].grid, calls[0].block, q.data(), k.data(), v.data(), o.data(), lse.data(),
         nq, nk, d, dv, hq, group, scale, causal);
  launch(delta, calls[1].grid, calls[1].block, d_out.data(), o.data(), dl.data(), nqd, dv);
  launch(kv, calls[2].grid, calls[2].block, q.data(), k.data(), v.data(), d_out.data(),
         lse.data(), dl.data(), dk.data(), dvv.data(), nq, nk, d, dv, hq, group, scale, causal);
  launch(q_kernel, calls[3].grid, calls[3].block, q.data(), k.data(), v.data(), d_out.data(),
         lse.data(), dl.data(), dq.data(), nq, nk, d, dv, hq, group, scale, causal);
  write_values(stdout, o);
  write_values(stdout, lse);
  write_values(stdout, dq);
  write_values(stdout, dk);
  write_values(stdout, dvv);
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  if (argc != 2 + 4 * 4) {
    std::fprintf(stderr, "usage: harness 4 x (KERNEL GX GY BLOCK) INPUT\n");
    return 2;
  }
  Call calls[4];
  for (int i = 0; i < 4; ++i) {
    char **a = argv + 1 + 4 * i;
    calls[i] = Call{a[0], dim3{(unsigned)std::atoi(a[1]), (unsigned)std::atoi(a[2]), 1},
                    dim3{(unsigned)std::atoi(a[3]), 1, 1}};
  }
  std::FILE *in = std::fopen(argv[argc - 1], "rb");
  if (!in) {
    std::fprintf(stderr, "cannot open %s\n", argv[argc - 1]);
    return 2;
  }
  int status = -1;
  // The four kernels of one element type and dimension, which the plan's
  // four names must all name.
#define PICK(SUFFIX, T, D)                                                                     \
  if (calls[0].name == "flash_forward_" #D "_" #SUFFIX) {                                      \
    if (calls[1].name != "flash_delta_" #D "_" #SUFFIX ||                                      \
        calls[2].name != "flash_backward_kv_" #D "_" #SUFFIX ||                                \
        calls[3].name != "flash_backward_q_" #D "_" #SUFFIX) {                                 \
      std::fprintf(stderr, "the plan mixes kernels: %s, %s, %s, %s\n", calls[0].name.c_str(), \
                   calls[1].name.c_str(), calls[2].name.c_str(), calls[3].name.c_str());      \
      return 2;                                                                                \
    }                                                                                          \
    status = run<T>(in, calls, flash_forward_##D##_##SUFFIX, flash_delta_##D##_##SUFFIX,  \
                    flash_backward_kv_##D##_##SUFFIX, flash_backward_q_##D##_##SUFFIX);        \
  }
#define PICK_D(D)                                                                              \
  PICK(f32, float, D)                                                                          \
  PICK(f16, __half, D)                                                                         \
  PICK(bf16, __nv_bfloat16, D)
  PICK_D(32)
  PICK_D(64)
  PICK_D(128)
  if (status < 0) {
    std::fprintf(stderr, "no kernel is named %s\n", calls[0].name.c_str());
    return 2;
  }
  return status;
}
