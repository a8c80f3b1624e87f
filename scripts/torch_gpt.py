#!/usr/bin/env python3
"""Chapter 3's GPT training step in PyTorch: the exact peak of a whole step.

The same model as the workbook's `Gpt` (pre-norm blocks, learned positions,
tanh-GELU MLP of 4h, a head tied to the token table, GPT-2's initialisation)
trained with `torch.optim.AdamW` (lr 1e-3) on random tokens, at the shape
`workbook plan` calibrates (its `calibrations[].peaks` and `seconds` at
batch 1, 2 and 4). Prints one JSON object:

    {"device", "torch", "config", "metrics": {
        "peak_materialized", "peak_sdpa",        bytes, the whole step's peak
        "time_materialized", "time_sdpa",        seconds, the median step after the first
        "first_time_materialized", ...}}         seconds, the first step (as the
                                                 workbook's calibrations time it)

Times are measured in a run of their own, outside the profiler.

The peak is measured from before the model exists to the end of the last
step, so it holds the parameters, the gradients, AdamW's state, the batch,
the activations and every temporary, as the workbook's step region does:
on a GPU from torch.cuda's allocator statistics, on the CPU from the
profiler's allocation events (exact to the byte; see torch_chapter2.py).
"materialized" keeps the attention's probabilities (the workbook's lean
recipe); "sdpa" is `scaled_dot_product_attention` (its tiled recipe).

    python3 scripts/torch_gpt.py [--device cuda] [--dtype bf16] [--batch 4]
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch_required  # noqa: F401  (before torch: says how to install it)

import torch
import torch.nn.functional as F
from torch import nn

from torch_chapter2 import Meter, check_cpu_meter, warm_up


class Block(nn.Module):
    def __init__(self, h, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-5), nn.LayerNorm(h, eps=1e-5)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        a = self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, a, h // a).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // a))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, hidden, heads, seq, vocab, attention):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Parameter(torch.empty(seq, hidden))
        self.blocks = nn.ModuleList(Block(hidden, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, targets):
        s = tokens.shape[1]
        x = self.wte(tokens) + self.wpe[:s]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x).flatten(0, 1) @ self.wte.weight.t()
        return F.cross_entropy(logits.float(), targets.flatten())


def train(args, device, dtype, attention):
    """`--steps` steps of a new model: each step's time."""
    torch.manual_seed(11)
    model = Gpt(args.layers, args.hidden, args.heads, args.seq, args.vocab, attention)
    model = model.to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(args.vocab, (args.batch, args.seq), device=device)
    targets = torch.randint(args.vocab, (args.batch, args.seq), device=device)
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del model, opt, tokens, targets
    return times


def step_peak(args, device, dtype, attention):
    """The whole training run's peak (model, optimizer, `--steps` steps), the
    first step's time and the median time of the steps after it. The times
    come from a second run outside the memory meter: on the CPU the profiler
    that counts the bytes also slows every operation down."""
    with Meter(device) as m:
        train(args, device, dtype, attention)
    times = train(args, device, dtype, attention)
    return m.peak, times[0], statistics.median(times[1:] or times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps run (the first is not timed)")
    args = ap.parse_args()
    if args.steps < 1 or args.hidden % args.heads:
        ap.error("--steps must be at least 1 and --hidden a multiple of --heads")
    device = torch.device(args.device)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    check_cpu_meter()
    warm_up(device)
    metrics = {}
    for attention in ("materialized", "sdpa"):
        peak, first, median = step_peak(args, device, dtype, attention)
        metrics[f"peak_{attention}"] = peak
        metrics[f"first_time_{attention}"] = first
        metrics[f"time_{attention}"] = median
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"
    config = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab", "batch", "dtype")}
    report = {"device": name, "torch": torch.__version__, "config": config, "metrics": metrics}
    json.dump(report, fp=sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
