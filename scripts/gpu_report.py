#!/usr/bin/env python3
"""The results folder of scripts/gpu-check.sh as Markdown: docs/comparison-gpu.md.

    python3 scripts/gpu_report.py RESULTS > docs/comparison-gpu.md

RESULTS holds what gpu-check.sh wrote: summary.tsv (each step's status and
seconds), info.out, chapter2.json and torch-chapter2.json (chapter 2 on both
sides), gpt-f32-RECIPE.json / gpt-bf16-RECIPE.json (`workbook plan --json`,
one recipe each: the GPT step's peaks and times at batch 1, 2 and 4; a
single gpt-f32.json of every recipe is read too), torch-gpt-f32.json /
torch-gpt-bf16.json (scripts/torch_gpt.py at batch 4), meter.out (the
meter's test) and plan-verify.json. What a step did not produce is said, not
guessed, and a file that cannot be read costs only its own section. Needs
only Python's standard library.
"""

import json
import pathlib
import sys

from compare import fmt, ratio, rows

# The workbook's recipes beside PyTorch's attention: the lean and direct
# recipes keep the probabilities as PyTorch's composed attention does; the
# tiled ones keep the log-sum-exp as scaled_dot_product_attention does;
# candle-nn's layers are the framework-cost baseline. The direct recipes
# run the same layers with no graph (each stage's backward called directly).
GPT_HEADER = (
    "workbook recipe",
    "PyTorch attention",
    "workbook peak",
    "PyTorch peak",
    "ratio",
    "workbook step",
    "PyTorch step",
    "ratio",
)
GPT_PAIRS = [
    ("candle", "materialized"),
    ("lean", "materialized"),
    ("direct", "materialized"),
    ("tiled", "sdpa"),
    ("direct_tiled", "sdpa"),
]


def load(folder, name):
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(folder):
    """The summary's rows: (step, status, seconds, limit)."""
    try:
        lines = (folder / "summary.tsv").read_text().splitlines()
    except OSError:
        return []
    return [tuple(line.split("\t")) for line in lines[1:] if line.count("\t") == 3]


def table(header, body):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(out)


def chapter2(folder):
    ours, theirs = load(folder, "chapter2.json"), load(folder, "torch-chapter2.json")
    if ours is None or theirs is None:
        missing = [n for n, v in (("chapter2.json", ours), ("torch-chapter2.json", theirs)) if v is None]
        return f"Not measured: {', '.join(missing)} missing or unreadable (see summary.tsv)."
    if ours["mode"] != theirs.get("mode"):
        return f"Not compared: the workbook ran at {ours['mode']} size, PyTorch at {theirs.get('mode')} size."
    head = (
        f"workbook {ours['workbook_version']} on {ours['device']} (meter {ours['meter']}); "
        f"torch {theirs['torch']} on {theirs['device']}; {ours['mode']} size.\n\n"
    )
    return head + table(("cell", "metric", "workbook", "PyTorch", "workbook / PyTorch"), rows(ours, theirs))


def chapters(folder):
    """Each chapter's cells as run on the card, with the assertions that failed
    and those the chapter checks on another kind of device only."""
    body = []
    cell_text = lambda text: " ".join(text.split()).replace("|", "\\|")
    for name in ("chapter2", "chapter3"):
        report = load(folder, f"{name}.json")
        if report is None:
            body.append((name, "-", "not run or no report (see summary.tsv)", "", ""))
            continue
        for cell in report["cells"]:
            assertions = cell.get("assertions", [])
            failed = [a["expr"] for a in assertions if not a["passed"] and not a.get("skipped")]
            elsewhere = [
                a["expr"]
                for a in assertions
                if a.get("skipped") and (a.get("message") or "").startswith("checked on ")
            ]
            # An error's first line (with RUST_BACKTRACE set, candle's
            # errors carry a backtrace after it).
            error = (cell.get("error") or "").strip().splitlines()
            why = error[0] if error else "; ".join(f"`{e}`" for e in failed)
            other = "; ".join(f"`{e}`" for e in elsewhere)
            body.append((name, cell["id"], cell["status"], cell_text(why), cell_text(other)))
    return table(("chapter", "cell", "status", "what failed", "checked on another device only"), body)


def gpt_calibrations(folder, dtype):
    """The uncheckpointed calibrations of every recipe `plan` measured in
    `dtype`, by recipe: from one file per recipe (a recipe that failed
    costs only its own) or one file of them all."""
    found = {}
    paths = sorted(folder.glob(f"gpt-{dtype}-*.json")) + [folder / f"gpt-{dtype}.json"]
    for path in paths:
        ours = load(folder, path.name)
        if ours is None:
            continue
        for c in ours["plan"]["calibrations"]:
            if not c["checkpointed"]:
                found.setdefault(c["recipe"], c)
    return found


def gpt(folder, dtype):
    calibrations = gpt_calibrations(folder, dtype)
    theirs = load(folder, f"torch-gpt-{dtype}.json")
    if not calibrations:
        return f"Not measured in {dtype}: the workbook's result is missing (see summary.tsv)."
    if theirs is None:
        # The workbook's side alone: PyTorch's was not measured.
        theirs = {"config": {"batch": 4}, "metrics": {}}
    batch = theirs["config"]["batch"]
    body = []
    for recipe, attention in GPT_PAIRS:
        c = calibrations.get(recipe)
        if c is None:
            body.append((recipe, attention, "not measured", "", "", "", "", ""))
            continue
        if batch not in c["batches"]:
            body.append((recipe, attention, f"batch {batch} not calibrated", "", "", "", "", ""))
            continue
        i = c["batches"].index(batch)
        peak, seconds = c["peaks"][i], c["seconds"][i]
        torch_peak = theirs["metrics"].get(f"peak_{attention}")
        # The workbook's calibrated step follows two warm-up steps of the
        # same model; PyTorch's first step loads and tunes its kernels, so
        # its steps after the first are the like for like.
        torch_time = theirs["metrics"].get(f"time_{attention}")
        body.append(
            (
                recipe,
                attention,
                fmt("peak", peak),
                fmt("peak", torch_peak),
                ratio(peak, torch_peak),
                fmt("time", seconds),
                fmt("time", torch_time),
                ratio(seconds, torch_time),
            )
        )
    cfg = theirs["config"]
    if "layers" not in cfg:
        head = f"Batch {batch}, {dtype}, AdamW; PyTorch's side was not measured (see summary.tsv).\n\n"
        return head + table(GPT_HEADER, body)
    head = (
        f"{cfg['layers']} blocks, hidden {cfg['hidden']}, {cfg['heads']} heads, {cfg['seq']} tokens, "
        f"vocabulary {cfg['vocab']}, batch {batch}, {dtype}, AdamW; torch {theirs['torch']} on "
        f"{theirs['device']}. Peaks from before the model exists to the step's end. Times: the "
        "workbook's calibrated step (`plan`'s, after two warm-up steps, ended by a device "
        "synchronisation) and PyTorch's median step after its first (which loads its kernels).\n\n"
    )
    return head + table(GPT_HEADER, body)


def machine(info):
    """info.out for the report: the libraries the binary found by name alone
    (their folders are the GPU machine's own), and the kernel without its
    release."""
    out = []
    for line in info.strip().splitlines():
        if line.startswith("CUDA libraries:"):
            continue
        if "=>" in line:
            name, _, where = line.partition("=>")
            line = f"{name.rstrip()} => {'not found' if 'not found' in where else 'found'}"
        elif line.startswith("Linux "):
            parts = line.split()
            line = f"{parts[0]} {parts[-1]}" if len(parts) >= 3 else line
        out.append(line)
    return "\n".join(out)


def meter(folder):
    """The meter's test: its result line, every test that did not pass and
    where each panicked (the harness prints a failed test's panic with its
    output, on stdout)."""
    lines = []
    for name in ("meter.out", "meter.err"):
        try:
            lines += (folder / name).read_text().splitlines()
        except OSError:
            pass
    if not lines:
        return "Not run (see summary.tsv)."
    kept = [
        line
        for line in lines
        if line.startswith("test result:")
        or (line.startswith("test ") and not line.endswith(" ok"))
        or "panicked" in line
        or line.startswith(("error", "thread"))
    ][:40]
    return "```\n" + "\n".join(kept or ["(no test lines: see gpu-check.log)"]) + "\n```"


def verified(folder):
    """`plan --verify`: the chosen step, predicted and measured on the card."""
    result = load(folder, "plan-verify.json")
    if result is None:
        return "Not measured (see summary.tsv)."
    chosen, check = result["plan"]["chosen"], result["verification"]
    how = f"{chosen['recipe']}, {chosen['dtype']}, micro-batch {chosen['micro_batch']} x {chosen['micro_steps']}"
    if chosen.get("checkpointed"):
        how += ", checkpointed"
    body = [
        ("peak", fmt("peak", check["predicted"]), fmt("peak", check["peak"]), ratio(check["peak"], check["predicted"])),
        ("step", fmt("time", chosen["seconds"]), fmt("time", check["seconds"]), ratio(check["seconds"], chosen["seconds"])),
    ]
    head = f"Within {fmt('bytes', check['budget'])} on {check['ranks']} rank(s) the plan chose {how}.\n\n"
    return head + table(("", "predicted", "measured", "measured / predicted"), body)


def section(title, make, *args):
    """A titled section; a file it cannot read costs only this section."""
    try:
        text = make(*args)
    except Exception as e:  # noqa: BLE001 (any malformed input: say it and go on)
        text = f"Could not be read: {type(e).__name__}: {e}"
    return f"## {title}\n\n{text}"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    folder = pathlib.Path(sys.argv[1])
    info = (folder / "info.out").read_text() if (folder / "info.out").exists() else "(no info.out)\n"
    parts = [
        "# The workbook on a GPU, beside PyTorch",
        "Written by `python3 scripts/gpu_report.py` from one run of `scripts/gpu-check.sh` (see "
        "the README's GPU section). Memory is the peak above the start of the measured step "
        "(the workbook's CUDA meter; PyTorch's `max_memory_allocated`); a ratio above 1 means "
        "the workbook held more or took longer.",
        "## The machine\n\n```\n" + machine(info) + "\n```",
        section("The run", lambda: table(("step", "status", "seconds", "limit"), steps(folder))),
        section("The meter's test", meter, folder),
        section("The chapters' cells", chapters, folder),
        section("Chapter 2's experiments", chapter2, folder),
        section("Chapter 3's GPT step, f32", gpt, folder, "f32"),
        section("Chapter 3's GPT step, bf16", gpt, folder, "bf16"),
        section("The plan, verified on the card", verified, folder),
    ]
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
