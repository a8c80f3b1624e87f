#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the CPU, forward and backward,
measured as the toolkit's attention bench measures the tiled attention:

    cargo run --release -p candle-tiled-attention --example bench -- --n 4096
    python3 scripts/torch_attention.py --n 4096

Median wall time of a forward and backward, GFLOP/s counted the same way
(14 n^2 d heads, half when causal), and the peak of the bytes allocated above
the start of a step, from the profiler's allocation events with
scripts/torch_chapter2.py's meter (checked first on a tensor of known size). Threads: torch.set_num_threads, default all cores.
"""

import argparse
import time

import torch_required  # noqa: F401  (before torch: says how to install it)

import torch
import torch.nn.functional as F

from torch_chapter2 import Meter, check_cpu_meter


def peak_bytes(fn):
    """Bytes allocated at most while `fn` runs, above its start (on the CPU:
    the profiler's allocation events, as scripts/torch_chapter2.py counts)."""
    with Meter(torch.device("cpu")) as m:
        fn()
    return m.peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    check_cpu_meter()
    torch.manual_seed(0)
    shape = (1, args.heads, args.n, args.dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    d_out = torch.randn(shape)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(d_out)
        for t in (q, k, v):
            t.grad = None

    step()  # warm-up
    times = []
    for _ in range(max(args.repeats, 1)):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    median = times[len(times) // 2]
    peak = peak_bytes(step)
    m = torch.randn(2048, 2048)
    m @ m
    g = []
    for _ in range(3):
        t = time.perf_counter()
        m @ m
        g.append(time.perf_counter() - t)
    gemm_rate = 2 * 2048**3 / sorted(g)[1] / 1e9
    flops = 14 * args.n**2 * args.dim * args.heads / (2 if args.causal else 1)
    rate = flops / median / 1e9
    print(
        f"n {args.n} heads {args.heads} dim {args.dim} causal {str(args.causal).lower()} "
        f"torch {torch.__version__} threads {torch.get_num_threads()}: "
        f"forward+backward median {median:.3f} s over {len(times)} runs, {rate:.1f} GFLOP/s, "
        f"{100 * rate / gemm_rate:.0f}% of the 2048^3 product's {gemm_rate:.1f} GFLOP/s, "
        f"peak {peak / 2**20:.2f} MiB above the inputs"
    )


if __name__ == "__main__":
    main()
