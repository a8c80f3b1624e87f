#!/usr/bin/env python3
"""The matrix products of chapter 3's GPT step in candle and in PyTorch.

    python3 scripts/compare_products.py [--runs 3] [--repeats 30] [--batch 4] [--hidden 256] ...

builds `cargo build --release -p workbook-models --example gpt_products`,
which times each dense layer's three products of one step (forward `x W^T`,
input gradient `g W`, weight gradient `g^T x`, on the layouts the toolkit's
lean layers use) with candle's f32 `matmul`, and times `torch.matmul` on
the same shapes and layouts with as many threads, one after the other,
`--runs` times. It prints one markdown table: each product's median time on
both sides, their paired ratio (run i against run i), and the sum over one
step. Most of a GPT step's time on the CPU is these products
(`scripts/compare_gpt.py` times whole steps), so this shows how much of the
difference between the two steps is the matrix library's.
"""

import argparse
import json
import statistics
import subprocess
import time

import torch_required  # noqa: F401  (before torch: says how to install it)

import torch

from compare_gpt import build


def torch_products(ours, repeats):
    """PyTorch's median time of each of the workbook's products."""
    torch.set_num_threads(ours["threads"])
    out = []
    for p in ours["products"]:
        m, k, n = p["m"], p["k"], p["n"]
        # The same layouts: the forward's right operand and the weight
        # gradient's left operand are transposed views.
        if p["product"].startswith("forward"):
            lhs, rhs = torch.randn(m, k), torch.randn(n, k).t()
        elif p["product"].startswith("weight"):
            lhs, rhs = torch.randn(k, m).t(), torch.randn(k, n)
        else:
            lhs, rhs = torch.randn(m, k), torch.randn(k, n)
        lhs @ rhs
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            c = lhs @ rhs
            times.append(time.perf_counter() - start)
            del c
        out.append(statistics.median(times))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="paired runs of each side")
    ap.add_argument("--repeats", type=int, default=30, help="timed products of each shape per run")
    for flag, default in [("batch", 4), ("layers", 4), ("hidden", 256), ("seq", 256), ("vocab", 512)]:
        ap.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args()
    if args.runs < 1 or args.repeats < 1:
        ap.error("--runs and --repeats at least 1")
    binary = build("gpt_products")
    flags = ["--repeats", str(args.repeats)]
    for flag in ["batch", "layers", "hidden", "seq", "vocab"]:
        flags += [f"--{flag}", str(getattr(args, flag))]
    ours, theirs = [], []
    for _ in range(args.runs):
        done = subprocess.run([binary] + flags, capture_output=True, text=True, check=True)
        ours.append(json.loads(done.stdout))
        theirs.append(torch_products(ours[-1], args.repeats))
    first = ours[0]
    print(f"candle on {first['threads']} threads, PyTorch {torch.__version__} on "
          f"{torch.get_num_threads()} threads; medians over {args.runs} runs\n")
    print("| layer | product | m x k x n | per step | candle (ms) | GFLOP/s | PyTorch (ms) | GFLOP/s | paired ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    step_ours, step_theirs = [], [0.0] * args.runs
    for i, p in enumerate(first["products"]):
        mine = [o["products"][i]["seconds"] for o in ours]
        yours = [t[i] for t in theirs]
        for r in range(args.runs):
            step_theirs[r] += yours[r] * p["count"]
        flops = 2.0 * p["m"] * p["k"] * p["n"] / 1e9
        a, b = statistics.median(mine), statistics.median(yours)
        paired = statistics.median(x / y for x, y in zip(mine, yours))
        print(f"| {p['layer']} | {p['product']} | {p['m']} x {p['k']} x {p['n']} | {p['count']} "
              f"| {a * 1e3:.3f} | {flops / a:.0f} | {b * 1e3:.3f} | {flops / b:.0f} | {paired:.2f} |")
    step_ours = [o["step_seconds"] for o in ours]
    paired = statistics.median(x / y for x, y in zip(step_ours, step_theirs))
    print(f"| **one step** | all of the above | | | {statistics.median(step_ours) * 1e3:.1f} | "
          f"| {statistics.median(step_theirs) * 1e3:.1f} | | {paired:.2f} |")


if __name__ == "__main__":
    main()
