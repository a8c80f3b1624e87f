#!/usr/bin/env python3
"""Chapter 3's GPT training step in the workbook and in PyTorch, side by side.

    python3 scripts/compare_gpt.py [--sweep] [--runs 3] [--steps 5] [--recipes direct,direct_tiled]

builds `cargo build --release -p workbook-models --example gpt_step`, runs
it for each recipe and `scripts/torch_gpt.py` (with the Python that runs this script),
one after the other, `--runs` times, at chapter 3's base model (4 blocks,
hidden 256, 4 heads, 256 tokens, vocabulary 512, batch 4, f32) and with
`--sweep` at each of the chapter's sweep points too (seq 512, batch 8,
layers 8, hidden 512, bf16). It prints one markdown table.

Each side's peak is the exact peak of a whole run (model, AdamW state, batch
and `--steps` steps), from a counting allocator and from PyTorch's profiler.
Each side's time is the median step after the first, taken per process; the
table gives the median over the runs of each, and the median of the paired
ratios (run i of the workbook against run i of PyTorch, which ran next to
it), a ratio that holds while a shared machine's load drifts. A ratio above
1 means the workbook used more.

The workbook's step runs on a thread of rayon's pool (the example's default,
`--pool joined`), as PyTorch's runs on OpenMP's master thread: each parallel
operation starts where it is called instead of being handed to a pool
thread while the caller sleeps.

The workbook's recipes are paired with PyTorch's attention of the same kind:
`direct`, `lean` and `candle` keep the attention's probabilities, as
PyTorch's composed attention does; `direct_tiled` and `tiled` keep only its
output and log-sum-exp, as `scaled_dot_product_attention` does.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

BASE = {"layers": 4, "hidden": 256, "heads": 4, "seq": 256, "vocab": 512, "batch": 4, "dtype": "f32"}
SWEEP = [{"seq": 512}, {"batch": 8}, {"layers": 8}, {"hidden": 512}, {"dtype": "bf16"}]
PAIRED = {
    "direct": "materialized",
    "lean": "materialized",
    "candle": "materialized",
    "direct_tiled": "sdpa",
    "tiled": "sdpa",
}


def flags(config, steps):
    out = ["--steps", str(steps)]
    for key, value in config.items():
        out += [f"--{key}", str(value)]
    return out


def run_json(cmd, cwd=None):
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def build(example="gpt_step"):
    """Builds the workbook's side once and returns its executable: every run
    then times the same binary, whatever happens to the sources meanwhile."""
    cmd = ["cargo", "build", "--release", "-p", "workbook-models", "--example", example,
           "--message-format=json-render-diagnostics"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    for line in done.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message["target"]["name"] == example:
            return message["executable"]
    sys.exit(f"cargo built no {example} executable")


def workbook(binary, recipe, config, steps):
    return run_json([binary, "--recipe", recipe] + flags(config, steps))


def torch(config, steps):
    script = [sys.executable, str(ROOT / "scripts" / "torch_gpt.py"), "--device", "cpu"]
    return run_json(script + flags(config, steps))["metrics"]


def describe(config):
    changed = [f"{k}={v}" for k, v in config.items() if BASE[k] != v]
    return ", ".join(changed) or "base"


def compare(binary, config, recipes, runs, steps):
    """One config's rows: (recipe, peaks, times) per side."""
    ours = {r: [] for r in recipes}
    theirs = []
    for _ in range(runs):
        for r in recipes:
            ours[r].append(workbook(binary, r, config, steps))
        theirs.append(torch(config, steps))
    rows = []
    for r in recipes:
        kind = PAIRED[r]
        peak_ours = statistics.median(o["peak"] for o in ours[r])
        peak_theirs = statistics.median(t[f"peak_{kind}"] for t in theirs)
        time_ours = [o["time"] for o in ours[r]]
        time_theirs = [t[f"time_{kind}"] for t in theirs]
        paired = statistics.median(a / b for a, b in zip(time_ours, time_theirs))
        rows.append(
            (
                describe(config),
                r,
                kind,
                peak_ours,
                peak_theirs,
                statistics.median(time_ours),
                statistics.median(time_theirs),
                paired,
            )
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="chapter 3's sweep points too")
    ap.add_argument("--runs", type=int, default=3, help="paired runs of each side")
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first is not timed)")
    ap.add_argument("--recipes", default="direct,direct_tiled", help="workbook recipes, comma-separated")
    args = ap.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in PAIRED]
    if unknown or args.runs < 1 or args.steps < 2:
        ap.error(f"recipes are among {', '.join(PAIRED)}; --runs at least 1, --steps at least 2")
    configs = [BASE] + ([{**BASE, **point} for point in SWEEP] if args.sweep else [])
    binary = build()
    print("| model | workbook | PyTorch | peak (MB) | PyTorch (MB) | ratio | step (ms) | PyTorch (ms) | paired ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for config in configs:
        for name, r, kind, po, pt, to, tt, paired in compare(binary, config, recipes, args.runs, args.steps):
            print(
                f"| {name} | {r} | {kind} | {po / 1e6:.1f} | {pt / 1e6:.1f} | {po / pt:.3f} "
                f"| {to * 1e3:.0f} | {tt * 1e3:.0f} | {paired:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
