// Launches candle's own kernels on the CPU through emulate.h
// (candle-toolkit-cuda-emulation) with the arguments candle-inplace's
// launches pass, read from the command line in the order of the kernel's
// own parameters:
//
//   HARNESS KERNEL GRID_X BLOCK_X BLOCK_Y BUFFERS ARG... INPUT
//
// BUFFERS: each buffer's element type (f32, f64, f16, bf16 or size_t) and
// length, `f32:70,size_t:6`, read in that order from INPUT (f64s,
// values.h). ARG, one per parameter: `null` or `BUFFER+OFFSET` for a
// pointer (the two pointers of an in-place launch name one buffer), a
// number for a scalar (rounded to a half type's nearest). Writes every buffer
// after the launch to standard output as f64s. The file including this
// one includes candle's kernels first and defines CANDLE_KERNELS(K) as
// K(name) for each kernel it launches.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

#include "emulate.h"
#include "values.h"

namespace {

using Buffer = std::variant<std::vector<float>, std::vector<double>, std::vector<__half>,
                             std::vector<__nv_bfloat16>, std::vector<size_t>>;

[[noreturn]] void fail(const std::string &why) {
  std::fprintf(stderr, "%s\n", why.c_str());
  std::exit(2);
}

struct Args {
  std::string kernel;
  std::vector<Buffer> buffers;
  char **next;
  char **end;
  unsigned param = 0;

  // The next parameter's argument, as the kernel's parameter type P.
  template <typename P> P take() {
    if (next == end) fail(kernel + ": fewer arguments than parameters");
    const std::string arg = *next++;
    ++param;
    if constexpr (std::is_pointer_v<P>) {
      using T = std::remove_const_t<std::remove_pointer_t<P>>;
      if (arg == "null") return nullptr;
      const size_t plus = arg.find('+');
      if (plus == std::string::npos) {
        fail(kernel + ": parameter " + std::to_string(param) + " is a pointer, given " + arg);
      }
      const size_t id = std::stoul(arg.substr(0, plus)), offset = std::stoul(arg.substr(plus + 1));
      if (id >= buffers.size()) fail(kernel + ": no buffer " + std::to_string(id));
      auto *v = std::get_if<std::vector<T>>(&buffers[id]);
      if (!v) {
        fail(kernel + ": parameter " + std::to_string(param) + " points to another type than buffer " +
             std::to_string(id) + " holds");
      }
      if (offset > v->size()) fail(kernel + ": an offset past buffer " + std::to_string(id));
      return v->data() + offset;
    } else {
      constexpr bool half_type = std::is_same_v<P, __half> || std::is_same_v<P, __nv_bfloat16>;
      static_assert(std::is_arithmetic_v<P> || half_type, "a scalar parameter");
      if (arg == "null" || arg.find('+') != std::string::npos) {
        fail(kernel + ": parameter " + std::to_string(param) + " is a scalar, given " + arg);
      }
      if constexpr (std::is_floating_point_v<P> || half_type) {
        return from_f64<P>(std::stod(arg));
      } else {
        return static_cast<P>(std::stoll(arg));
      }
    }
  }
};

template <typename... P> void run(void (*kernel)(P...), dim3 grid, dim3 block, Args &a) {
  // A braced list's elements are taken in order.
  std::tuple<P...> params{a.take<P>()...};
  if (a.next != a.end) fail(a.kernel + ": more arguments than parameters");
  std::apply([&](P... p) { launch(kernel, grid, block, p...); }, params);
}

std::vector<Buffer> read_buffers(const std::string &spec, std::FILE *in) {
  std::vector<Buffer> buffers;
  size_t at = 0;
  while (at < spec.size()) {
    size_t comma = spec.find(',', at);
    if (comma == std::string::npos) comma = spec.size();
    const std::string one = spec.substr(at, comma - at);
    const size_t colon = one.find(':');
    if (colon == std::string::npos) fail("a buffer is TYPE:LENGTH, not " + one);
    const std::string type = one.substr(0, colon);
    const size_t n = std::stoul(one.substr(colon + 1));
    if (type == "f32") {
      buffers.emplace_back(read_values<float>(in, n));
    } else if (type == "f64") {
      buffers.emplace_back(read_values<double>(in, n));
    } else if (type == "f16") {
      buffers.emplace_back(read_values<__half>(in, n));
    } else if (type == "bf16") {
      buffers.emplace_back(read_values<__nv_bfloat16>(in, n));
    } else if (type == "size_t") {
      std::vector<size_t> v;
      for (double d : read_values<double>(in, n)) v.push_back(static_cast<size_t>(d));
      buffers.emplace_back(std::move(v));
    } else {
      fail("a buffer's type is f32, f64, f16, bf16 or size_t, not " + type);
    }
    at = comma + 1;
  }
  return buffers;
}

void write_buffers(const std::vector<Buffer> &buffers) {
  for (const Buffer &b : buffers) {
    std::visit(
        [](const auto &v) {
          std::vector<double> out;
          for (const auto &x : v) out.push_back(static_cast<double>(x));
          write_values(stdout, out);
        },
        b);
  }
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 7) fail("usage: HARNESS KERNEL GRID_X BLOCK_X BLOCK_Y BUFFERS ARG... INPUT");
  std::FILE *in = std::fopen(argv[argc - 1], "rb");
  if (!in) fail(std::string("cannot open ") + argv[argc - 1]);
  Args a{argv[1], read_buffers(argv[5], in), argv + 6, argv + argc - 1};
  const dim3 grid{(unsigned)std::stoul(argv[2]), 1, 1};
  const dim3 block{(unsigned)std::stoul(argv[3]), (unsigned)std::stoul(argv[4]), 1};
#define CANDLE_KERNEL(NAME)                                                                   \
  if (a.kernel == #NAME) {                                                                    \
    run(NAME, grid, block, a);                                                                \
    write_buffers(a.buffers);                                                                 \
    return 0;                                                                                 \
  }
  CANDLE_KERNELS(CANDLE_KERNEL)
  fail("no kernel is named " + a.kernel);
}
