#!/usr/bin/env python3
"""Chapter 2 in the workbook and in PyTorch, side by side, as ratios.

    workbook run chapter2 --device cuda --format json > workbook.json
    python3 scripts/torch_chapter2.py > torch.json
    python3 scripts/compare.py workbook.json torch.json

Both must be of the same mode (full or check size). A ratio above 1 means the
workbook (candle) used more memory or time than PyTorch for the same
experiment; memory is the peak above the start of the measured step in both.
"""

import json
import math
import sys


def fmt(name, value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if "ratio" in name or "overhead" in name:
        return f"{value:,.3g}"
    if "bytes" in name or name.startswith(("peak", "act_peak", "act_held", "activation_peak")):
        return f"{value / 2**20:,.2f} MiB"
    if "time" in name or "seconds" in name:
        return f"{value * 1e3:,.2f} ms"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.4g}"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        ours = json.load(f)
    with open(sys.argv[2]) as f:
        theirs = json.load(f)
    if ours["mode"] != theirs["mode"]:
        sys.exit(f"modes differ: workbook {ours['mode']}, torch {theirs['mode']}")
    print(f"workbook {ours['workbook_version']} on {ours['device']} (meter {ours['meter']})")
    print(f"torch {theirs['torch']} on {theirs['device']}, {ours['mode']} size\n")
    rows = [("cell", "metric", "workbook", "torch", "workbook / torch")]
    for cell in ours["cells"]:
        torch_metrics = theirs["metrics"].get(cell["id"], {})
        for name, value in torch_metrics.items():
            mine = cell["metrics"].get(name)
            ratio = "n/a"
            if isinstance(mine, (int, float)) and isinstance(value, (int, float)):
                if value and not math.isnan(value) and not math.isnan(mine):
                    ratio = f"{mine / value:.2f}"
            rows.append((cell["id"], name, fmt(name, mine), fmt(name, value), ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
