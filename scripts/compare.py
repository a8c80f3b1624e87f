#!/usr/bin/env python3
"""Chapter 2 in the workbook and in PyTorch, side by side, as ratios.

    python3 scripts/compare.py --run [--check] [--device cuda] [--cell ID]...

runs both (the workbook through `cargo run --release`, PyTorch with the
Python that runs this script) and prints the table; or, from saved reports,

    workbook run chapter2 --device cuda --format json > workbook.json
    python3 scripts/torch_chapter2.py --device cuda > torch.json
    python3 scripts/compare.py workbook.json torch.json

Both must be of the same mode (full or check size). A ratio above 1 means the
workbook (candle) used more memory or time than PyTorch for the same
experiment; memory is the peak above the start of the measured step in both.
"""

import argparse
import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A cell's other metrics for the same experiment as PyTorch's NAME, shown
# beside it: NAME_candle is the step on candle-nn's layers and candle's own
# backward where the cell trains on the toolkit's lean path (what the
# framework costs); the attention cell's materialized attention is the plain
# computation without a graph (two n x n matrices at its peak, where
# PyTorch's autograd holds three), its naive one composed of candle's
# operations; the offload cell's device step is candle_nn's AdamW, its lean
# one the toolkit's in-place LeanAdamW.
ALSO = {
    ("attention", "peak_naive"): ["peak_materialized"],
    ("attention", "time_naive"): ["time_materialized"],
    ("offload", "step_seconds_device"): ["step_seconds_device_lean"],
}


def run(check, device, cells):
    """Both sides' reports, measured now: the whole chapter, or `cells`."""
    flags = (["--check"] if check else []) + ["--device", device]
    for cell in cells:
        flags += ["--cell", cell]
    workbook = ["cargo", "run", "--quiet", "--release"]
    if device == "cuda":
        workbook += ["--features", "cuda"]
    workbook += ["--", "run", "chapter2", "--format", "json"] + flags
    # The workbook exits 1 when an assertion fails; its report is still whole.
    ours = subprocess.run(workbook, cwd=ROOT, capture_output=True, text=True)
    if not ours.stdout.strip():
        sys.exit(f"the workbook printed no report:\n{ours.stderr}")
    torch_script = [sys.executable, str(ROOT / "scripts" / "torch_chapter2.py")] + flags
    theirs = subprocess.run(torch_script, capture_output=True, text=True)
    if theirs.returncode != 0:
        sys.exit(f"scripts/torch_chapter2.py failed:\n{theirs.stderr}")
    return json.loads(ours.stdout), json.loads(theirs.stdout)


def number(value):
    """A metric as a float: the workbook writes NaN and the infinities as the
    strings "NaN", "inf" and "-inf" (JSON has no such numbers); None where
    the value is missing or not a number at all."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def fmt(name, value):
    value = number(value)
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if "ratio" in name or "overhead" in name:
        return f"{value:,.3g}"
    if "bytes" in name or name.startswith(("peak", "act_peak", "act_held", "activation_peak")):
        return f"{value / 2**20:,.2f} MiB"
    if "time" in name or "seconds" in name:
        return f"{value * 1e3:,.2f} ms"
    if value.is_integer():
        return f"{value:,.0f}"
    return f"{value:,.4g}"


def ratio(mine, theirs):
    """mine / theirs, or n/a where either is missing or not finite, or
    theirs is 0."""
    mine, theirs = number(mine), number(theirs)
    if mine is None or theirs is None or not theirs:
        return "n/a"
    if not (math.isfinite(mine) and math.isfinite(theirs)):
        return "n/a"
    return f"{mine / theirs:.2f}"


def rows(ours, theirs):
    """(cell, metric, workbook, torch, ratio) for every metric PyTorch
    measured, each followed by the cell's other ways of the same experiment."""
    out = []
    for cell in ours["cells"]:
        torch_metrics = theirs["metrics"].get(cell["id"], {})
        for name, value in torch_metrics.items():
            mine = cell["metrics"].get(name)
            out.append((cell["id"], name, fmt(name, mine), fmt(name, value), ratio(mine, value)))
            # The same experiment another way, where the cell has it.
            for other in ALSO.get((cell["id"], name), [f"{name}_candle", f"{name}_lean"]):
                if other in cell["metrics"]:
                    mine = cell["metrics"][other]
                    out.append((cell["id"], other, fmt(name, mine), fmt(name, value), ratio(mine, value)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="*", help="workbook.json torch.json")
    ap.add_argument("--run", action="store_true", help="measure both now")
    ap.add_argument("--check", action="store_true", help="with --run: check-size parameters")
    ap.add_argument("--device", default="cpu", help="with --run: cpu or cuda")
    ap.add_argument("--cell", action="append", default=[], help="with --run: only this cell (repeat for several)")
    args = ap.parse_args()
    if args.run:
        ours, theirs = run(args.check, args.device, args.cell)
    elif len(args.reports) == 2:
        with open(args.reports[0]) as f:
            ours = json.load(f)
        with open(args.reports[1]) as f:
            theirs = json.load(f)
    else:
        ap.error("give --run, or the workbook's and PyTorch's reports")
    if ours["mode"] != theirs["mode"]:
        sys.exit(f"modes differ: workbook {ours['mode']}, torch {theirs['mode']}")
    print(f"workbook {ours['workbook_version']} on {ours['device']} (meter {ours['meter']})")
    print(f"torch {theirs['torch']} on {theirs['device']}, {ours['mode']} size\n")
    table = [("cell", "metric", "workbook", "torch", "workbook / torch")] + rows(ours, theirs)
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
