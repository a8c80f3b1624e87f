// Runs the tiled attention's CUDA kernels (kernels/flash_*.cu) on the CPU
// through emulate.h (candle-toolkit-cuda-emulation), with the launches
// src/flash_plan.rs gives a GPU.
//
//   harness INPUT OUTPUT FORWARD GX GY BLOCK DELTA GX GY BLOCK
//           BACKWARD_KV GX GY BLOCK BACKWARD_Q GX GY BLOCK
//
// INPUT: i32 batch, q_heads, kv_heads, nq, nk, d, dv, causal; f32 scale;
// then q, k, v and d_out as f32, each rounded to the kernels' element type
// here. OUTPUT: out, lse, dq, dk and dv as f32. Outputs start as a poison
// value, so an element no kernel wrote shows.
#include "emulate.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../../kernels/flash_128.cu"
#include "../../kernels/flash_32.cu"
#include "../../kernels/flash_64.cu"

namespace {

struct Call {
  std::string name;
  dim3 grid, block;
};

const float POISON = 1.0e30f;

std::vector<float> read_floats(std::FILE *f, size_t n) {
  std::vector<float> v(n);
  if (std::fread(v.data(), sizeof(float), n, f) != n) {
    std::fprintf(stderr, "input ends early\n");
    std::exit(2);
  }
  return v;
}

template <typename T> std::vector<T> rounded(const std::vector<float> &v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) put(&out[i], v[i]);
  return out;
}

template <typename T> void write(std::FILE *f, const std::vector<T> &v) {
  for (const T &x : v) {
    float y = to_f32(x);
    std::fwrite(&y, sizeof y, 1, f);
  }
}

template <typename T, typename Fwd, typename Delta, typename Kv, typename Q>
int run(std::FILE *in, std::FILE *out, const Call *calls, Fwd fwd, Delta delta, Kv kv, Q q_kernel) {
  std::int32_t h[8];
  float scale;
  if (std::fread(h, sizeof h[0], 8, in) != 8 || std::fread(&scale, sizeof scale, 1, in) != 1) {
    std::fprintf(stderr, "input has no header\n");
    return 2;
  }
  const int b = h[0], hq = h[1], hkv = h[2], nq = h[3], nk = h[4], d = h[5], dv = h[6];
  const int causal = h[7], group = hq / hkv;
  const size_t nqd = (size_t)b * hq * nq, nkd = (size_t)b * hkv * nk;
  auto q = rounded<T>(read_floats(in, nqd * d));
  auto k = rounded<T>(read_floats(in, nkd * d));
  auto v = rounded<T>(read_floats(in, nkd * dv));
  auto d_out = rounded<T>(read_floats(in, nqd * dv));
  T poison;
  put(&poison, POISON);
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
  write(out, o);
  write(out, lse);
  write(out, dq);
  write(out, dk);
  write(out, dvv);
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  if (argc != 3 + 4 * 4) {
    std::fprintf(stderr, "usage: harness INPUT OUTPUT then 4 x (KERNEL GX GY BLOCK)\n");
    return 2;
  }
  Call calls[4];
  for (int i = 0; i < 4; ++i) {
    char **a = argv + 3 + 4 * i;
    calls[i] = Call{a[0], dim3{(unsigned)std::atoi(a[1]), (unsigned)std::atoi(a[2]), 1},
                    dim3{(unsigned)std::atoi(a[3]), 1, 1}};
  }
  std::FILE *in = std::fopen(argv[1], "rb");
  std::FILE *out = std::fopen(argv[2], "wb");
  if (!in || !out) {
    std::fprintf(stderr, "cannot open %s or %s\n", argv[1], argv[2]);
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
    status = run<T>(in, out, calls, flash_forward_##D##_##SUFFIX, flash_delta_##D##_##SUFFIX,  \
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
  std::fclose(out);
  return status;
}
