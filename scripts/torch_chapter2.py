#!/usr/bin/env python3
"""Chapter 2's experiments in PyTorch, at the sizes chapters/chapter2.toml gives.

Prints one JSON object: {"device": ..., "mode": ..., "metrics": {name: value}},
with the metric names the workbook's cells report, so that scripts/compare.py
can set the two side by side. Memory is the peak (or what stays allocated)
above the start of the measured step, as the workbook's regions measure it:
on a GPU from torch.cuda's allocator statistics, on the CPU from the
profiler's allocation events (exact to the byte, checked on a tensor of known
size before anything else). Times are in seconds: for the checkpointing
cell the median of its runs, as the workbook's cell reports them; for the
others the best of a few runs, as theirs do.

    python3 scripts/torch_chapter2.py [--check] > torch.json
"""

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
import tomllib

import torch_required  # noqa: F401  (before torch: says how to install it)

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint_sequential

ROOT = pathlib.Path(__file__).resolve().parent.parent


def lay_over(base, over):
    """`over` laid over `base` as the workbook lays a check table over the
    full one: tables merged key by key at any depth, other values replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = lay_over(merged[key], value)
        else:
            merged[key] = value
    return merged


def params(chapter, cell_id, check):
    cell = next(c for c in chapter["cells"] if c["id"] == cell_id)
    p = dict(cell.get("params", {}))
    if check:
        p = lay_over(p, cell.get("check", {}))
    return p


class Meter:
    """Memory of a measured block above its start: `peak` (the most allocated
    at once) and `held` (what is still allocated at its end). On a GPU from
    the CUDA allocator's statistics; on the CPU from the profiler's
    allocation events, summed in the order they happened (exact to the byte:
    `check_cpu_meter` checks a tensor of known size first)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
            self.held = torch.cuda.memory_allocated() - self.start
            return
        self.prof.__exit__(*exc)
        events = [e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        now = peak = 0
        for e in events:
            now += e.nbytes()
            peak = max(peak, now)
        self.peak, self.held = peak, now


def check_cpu_meter():
    """A 1000 x 1000 f32 tensor is 4,000,000 bytes: the CPU meter must say so."""
    with Meter(torch.device("cpu")) as m:
        t = torch.zeros(1000, 1000)
    del t
    if (m.peak, m.held) != (4_000_000, 4_000_000):
        sys.exit(f"the CPU meter reads peak {m.peak}, held {m.held} for a 4,000,000-byte tensor")


def times(fn, device, repeats):
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def best_time(fn, device, repeats=3):
    return min(times(fn, device, repeats))


def median_time(fn, device, repeats=3):
    return statistics.median(times(fn, device, repeats))


def mlp(widths, act=nn.ReLU):
    """Linear layers of the given widths, an activation between each two (the
    workbook's `Mlp::new`)."""
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i + 2 < len(widths):
            layers.append(act())
    return nn.Sequential(*layers)


def stack(width, depth, act):
    """`depth` blocks of Linear(width, width) + activation (the workbook's
    `Mlp::stack`, the deep model of the sweeps)."""
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), act())])


def warm_up(device):
    """Matrix products in each dtype before anything is measured, as the
    workbook does: cuBLAS's workspace and kernels are loaded once, on first use."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (8, 64, 512):
            a = torch.ones(n, n, device=device, dtype=dtype, requires_grad=True)
            (a @ a).float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()


def footprint(chapter, check, device, out):
    p = params(chapter, "footprint", check)
    out["small_params"] = sum(x.numel() for x in mlp(p["small"]).parameters())
    out["large_params"] = sum(x.numel() for x in mlp(p["large"]).parameters())
    for name, dtype in [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)]:
        with Meter(device) as m:
            model = mlp(p["state_model"]).to(device=device, dtype=dtype)
        out[f"params_bytes_{name}"] = m.held
        x = torch.randn(p["batch"], p["state_model"][0], device=device, dtype=dtype)
        y = torch.randint(0, p["state_model"][-1], (p["batch"],), device=device)
        with Meter(device) as m:
            F.cross_entropy(model(x).float(), y).backward()
        out[f"grads_bytes_{name}"] = m.held
        del x, y
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with Meter(device) as m:
            opt.step()
        out[f"optimizer_bytes_{name}"] = m.held
        del model, opt


def train_peak(model, x, y, micro, device):
    """Peak of one step's forward and backward, in `micro` pieces."""
    with Meter(device) as m:
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (F.cross_entropy(model(xs), ys) / micro).backward()
    return m.peak


def accumulation(chapter, check, device, out):
    p = params(chapter, "accumulation", check)
    w = p["sweep_width"]
    model = stack(w, p["sweep_depth"], nn.ReLU).to(device)
    for size, batch in [("small", p["small_batch"]), ("large", p["large_batch"])]:
        x = torch.randn(batch, w, device=device)
        y = torch.randint(0, w, (batch,), device=device)
        model.zero_grad(set_to_none=True)
        out[f"peak_full_{size}"] = train_peak(model, x, y, 1, device)
        model.zero_grad(set_to_none=True)
        out[f"peak_accum_{size}"] = train_peak(model, x, y, p["compare_steps"], device)
        model.zero_grad(set_to_none=True)


def checkpointing(chapter, check, device, out):
    p = params(chapter, "checkpointing", check)
    w, depth, batch = p["stack_width"], p["stack_depth"], p["stack_batch"]
    # GELU in its tanh approximation, as candle's `gelu`.
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.GELU(approximate="tanh")) for _ in range(depth)]).to(device)
    # As the workbook's cell: a data batch (no gradient wanted) and class
    # labels, the mean cross-entropy as the loss.
    x = torch.randn(batch, w, device=device)
    labels = torch.randint(0, w, (batch,), device=device)

    def step(segments):
        blocks.zero_grad(set_to_none=True)
        if segments is None:
            y = blocks(x)
        else:
            y = checkpoint_sequential(blocks, segments, x, use_reentrant=False)
        F.cross_entropy(y, labels).backward()

    def peak(segments):
        step(segments)
        blocks.zero_grad(set_to_none=True)
        with Meter(device) as m:
            step(segments)
        return m.peak

    out["peak_plain"] = peak(None)
    peaks = {s: peak(s) for s in p["segments"]}
    best = min(peaks, key=peaks.get)
    out["peak_best"] = peaks[best]
    # The median of the runs, as the workbook's checkpointing cell reports.
    out["time_plain"] = median_time(lambda: step(None), device, p["repeats"])
    out["time_best"] = median_time(lambda: step(best), device, p["repeats"])
    out["time_overhead"] = out["time_best"] / out["time_plain"]


def precision(chapter, check, device, out):
    """The forward alone, f32 master weights, computing in f32 or (autocast)
    f16 and bf16: what it keeps for the backward, and its peak."""
    p = params(chapter, "precision", check)
    w, depth, batch = p["act_width"], p["act_depth"], p["act_batch"]
    model = stack(w, depth, lambda: nn.GELU(approximate="tanh")).to(device)
    x = torch.randn(batch, w, device=device)
    for name, dtype in [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)]:
        with Meter(device) as m:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                y = model(x)
        out[f"act_held_{name}"] = m.held
        out[f"act_peak_{name}"] = m.peak
        del y
    for name in ("f16", "bf16"):
        out[f"act_held_ratio_{name}"] = out[f"act_held_{name}"] / out["act_held_f32"]
        out[f"act_peak_ratio_{name}"] = out[f"act_peak_{name}"] / out["act_peak_f32"]


def offload(chapter, check, device, out):
    p = params(chapter, "offload", check)
    model = stack(p["width"], p["depth"], nn.ReLU).to(device)
    out["param_bytes"] = sum(x.numel() * x.element_size() for x in model.parameters())
    x = torch.randn(p["batch"], p["width"], device=device)
    y = torch.randint(0, p["width"], (p["batch"],), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"])
    F.cross_entropy(model(x), y).backward()
    with Meter(device) as m:
        opt.step()
    out["device_optimizer_bytes_plain"] = m.held

    # As the workbook's cell: the optimizer's step alone, after a backward,
    # a mean over the cell's steps.
    total = 0.0
    for _ in range(p["steps"]):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        total += time.perf_counter() - t
    out["step_seconds_device"] = total / p["steps"]


def attention(chapter, check, device, out):
    p = params(chapter, "attention", check)
    h, d, n = p["heads"], p["head_dim"], max(p["lengths"])

    def naive(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(d)
        return torch.softmax(s, dim=-1) @ v

    def flash(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    # As the workbook's cell: the naive attention's gradients from the loss
    # sum(out * d_out), the fused kernel's backward given d_out itself.
    d_out = torch.randn(1, h, n, d, device=device)
    for name, fn in [("naive", naive), ("tiled", flash)]:
        q, k, v = (torch.randn(1, h, n, d, device=device, requires_grad=True) for _ in range(3))

        def step():
            out = fn(q, k, v)
            if name == "naive":
                (out * d_out).sum().backward()
            else:
                out.backward(d_out)
            for t in (q, k, v):
                t.grad = None

        step()
        with Meter(device) as m:
            step()
        out[f"peak_{name}"] = m.peak
        out[f"time_{name}"] = best_time(step, device, p["repeats"])
    out["peak_ratio_naive_tiled"] = out["peak_naive"] / out["peak_tiled"]
    out["time_ratio_tiled_naive"] = out["time_tiled"] / out["time_naive"]


# The chapter's cells, in order; each is named as its cell's id.
EXPERIMENTS = [footprint, accumulation, checkpointing, precision, offload, attention]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check-size parameters")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--cell",
        action="append",
        choices=[e.__name__ for e in EXPERIMENTS],
        help="run only this cell's experiment (repeat for several)",
    )
    args = ap.parse_args()
    chapter = tomllib.loads((ROOT / "chapters" / "chapter2.toml").read_text())
    device = torch.device(args.device)
    torch.manual_seed(47)
    check_cpu_meter()
    warm_up(device)
    metrics = {}
    for experiment in EXPERIMENTS:
        if args.cell and experiment.__name__ not in args.cell:
            continue
        out = {}
        experiment(chapter, args.check, device, out)
        metrics[experiment.__name__] = out
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"
    # What could not be measured is null, as in the workbook's report.
    for out in metrics.values():
        for key, value in out.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
    report = {
        "device": name,
        "torch": torch.__version__,
        "mode": "check" if args.check else "full",
        "metrics": metrics,
    }
    json.dump(report, fp=sys.stdout, indent=1, allow_nan=False)
    print()


if __name__ == "__main__":
    main()
