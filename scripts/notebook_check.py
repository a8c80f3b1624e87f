#!/usr/bin/env python3
"""Executes a chapter's notebook through Jupyter and checks what it shows.

Runs NOTEBOOK with nbclient and the "Rust (workbook)" kernel (`workbook
kernel install`), in the notebook's folder as Jupyter would, writes the
executed notebook into --output-dir, and checks every code cell: none
errored, and each cell that runs a chapter cell (`wb.run`, `wb.run_cell`)
displays its results as one HTML block marked passed. Prints each code
cell's time.

A chapter cell's results are shown by `wb.run`, `wb.run_cell` or, for an
exercise, `wb.grade`. An exercise (a code cell tagged `exercise`, its reference solution in its
`workbook.solution` metadata) is checked as a learner meets it: the cell that
grades it (`wb.grade`) must first show it unfinished (not passed, with the
`todo!` of the cell as its error) while the kernel keeps its state; then the
exercise cell is run again with the reference solution, as a learner who
solved it, and the grading cell again, which must pass.

With --vary CELL FIELD METRIC V1 V2 ..., the experiment of CELL is then run
again in the same kernel, as a learner who edits a parameter would, once
per value of FIELD, and METRIC must grow with it.

    WORKBOOK_CHECK_MODE=1 python3 scripts/notebook_check.py chapters/chapter2.ipynb \\
        --vary checkpointing stack_batch peak_plain 256 512

Needs nbclient (pip install nbclient). Exit status 0 when every
check holds, 1 when one fails, 2 when something is missing.
"""

import argparse
import datetime
import json
import os
import re
import sys


def seconds(cell):
    """The cell's execution time from nbclient's timing metadata."""
    ex = cell.get("metadata", {}).get("execution", {})
    start, end = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))
    return (parse(end) - parse(start)).total_seconds()


def html_of(cell):
    """The HTML a cell displayed."""
    return "".join(
        "".join(o.get("data", {}).get("text/html", ""))
        for o in cell.get("outputs", [])
        if o["output_type"] in ("execute_result", "display_data")
    )


def unfinished_problem(cell):
    """What is wrong with a grading cell run on an unfinished exercise (one
    that failed its notebook cell raised before this is asked)."""
    html = html_of(cell)
    if not html.startswith('<div class="workbook">'):
        return "shows no results block for the unfinished exercise"
    if '<span class="badge passed">passed</span>' in html:
        return "passed the unfinished exercise"
    if "not yet implemented" not in html:
        return "does not show the exercise's todo!() as its error"
    return None


def problems_of(cell):
    """What is wrong with one executed code cell, if anything."""
    source = "".join(cell["source"])
    errors = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
    if errors:
        return "errored: %s" % errors[0].get("evalue", "")
    if re.search(r"\bwb\.(run|run_cell|grade)\(", source):
        html = html_of(cell)
        if not html.startswith('<div class="workbook">'):
            return "shows no results block (its outputs: %s)" % [
                o["output_type"] for o in cell.get("outputs", [])]
        if '<span class="badge passed">passed</span>' not in html:
            return "its chapter cell did not pass"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("notebook")
    ap.add_argument("--output-dir", help="where the executed notebook is written")
    ap.add_argument("--kernel", default="rust-workbook", help="the kernel spec's name")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds a cell may take")
    ap.add_argument("--vary", nargs="+", metavar="ARG",
                    help="CELL FIELD METRIC V1 V2 ...: rerun CELL's experiment per value")
    args = ap.parse_args()
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
        from nbclient.util import run_sync
    except ImportError:
        print("error: nbclient is not installed: pip install nbclient", file=sys.stderr)
        return 2
    if args.vary is not None and len(args.vary) < 5:
        print("error: --vary takes CELL FIELD METRIC and at least two values", file=sys.stderr)
        return 2

    path = os.path.abspath(args.notebook)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=args.kernel, timeout=args.timeout,
                            resources={"metadata": {"path": os.path.dirname(path)}})
    failed = False
    varied = []
    exercise = None  # (index, reference solution) of the exercise awaiting its grade
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, index)
                if "exercise" in cell.get("metadata", {}).get("tags", []):
                    solution = cell.metadata.get("workbook", {}).get("solution")
                    if not solution:
                        print("FAIL  exercise cell `%s` has no reference solution" % cell.get("id"))
                        failed = True
                    if exercise:
                        print("FAIL  exercise cell `%s` has no grading cell before the next "
                              "exercise" % nb.cells[exercise[0]].get("id"))
                        failed = True
                    exercise = (index, solution)
                elif re.search(r"\bwb\.grade\(", "".join(cell.source)) and exercise:
                    problem = unfinished_problem(cell)
                    print("%s  cell `%s` on the unfinished exercise: %s" % (
                        "FAIL" if problem else "ok  ", cell.get("id"),
                        problem or "not passed, its todo!() shown, the kernel kept"))
                    failed |= problem is not None
                    # The learner's solution: the exercise cell, then its grade, again.
                    at, solution = exercise
                    exercise = None
                    nb.cells[at].source = solution or ""
                    rerun_failed = False
                    for again in (at, index):
                        try:
                            client.execute_cell(nb.cells[again], again)
                        except CellExecutionError as e:
                            print("FAIL  cell `%s` failed with the exercise's reference "
                                  "solution:\n%s" % (nb.cells[again].get("id"), e),
                                  file=sys.stderr)
                            rerun_failed = True
                            break
                    if rerun_failed:
                        failed = True
                        break
            except CellExecutionError as e:
                print("FAIL  cell `%s` failed:\n%s" % (cell.get("id"), e), file=sys.stderr)
                failed = True
                break
        if exercise and not failed:
            print("FAIL  exercise cell `%s` has no grading cell (`wb.grade`) after it"
                  % nb.cells[exercise[0]].get("id"))
            failed = True
        # After a failed cell the kernel has lost its variables: nothing to vary.
        if args.vary and not failed:
            cell_id, field, metric, *values = args.vary
            run = next((c for c in nb.cells if c.get("id") == cell_id), None)
            text = "".join(run.source) if run else ""
            match = re.search(r"let p: (\w+) = wb\.params\(.*?\);\s*"
                              r"wb\.run\((\"[^\"]+\"), ([\w:]+), p\.clone\(\), (\w+)\)", text)
            if not match:
                print("FAIL  notebook cell `%s` runs no experiment in the kernel" % cell_id)
                failed = True
                values = []
            for value in values:
                params, cell, plugin, entry = match.groups()
                code = ('wb.run(%s, %s, %s { %s: %s, ..wb.params(%s) }, %s).cell().metrics[%s]'
                        % (cell, plugin, params, field, value, cell, entry, json.dumps(metric)))
                shown = []

                def hook(msg):
                    if msg["msg_type"] == "execute_result":
                        shown.append(msg["content"]["data"].get("text/plain", ""))
                    elif msg["msg_type"] == "error":
                        shown.append("error: " + msg["content"].get("evalue", ""))

                run_sync(client.kc.execute_interactive)(
                    code, timeout=args.timeout, output_hook=hook)
                varied.append((value, "".join(shown).strip()))

    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        nbformat.write(nb, os.path.join(args.output_dir, os.path.basename(path)))
    times = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        errored = any(o["output_type"] == "error" for o in cell.get("outputs", []))
        if cell.get("execution_count") is None and not errored:
            problem = "did not run"
        else:
            problem = problems_of(cell)
        times[cell.get("id")] = seconds(cell)
        if problem:
            print("FAIL  cell `%s` %s" % (cell.get("id"), problem))
            failed = True
    if varied:
        try:
            measured = [float(v) for _, v in varied]
        except ValueError:
            measured = None
        grows = measured is not None and all(a < b for a, b in zip(measured, measured[1:]))
        print("%s  %s of `%s` as %s varies: %s" % (
            "ok  " if grows else "FAIL", args.vary[2], args.vary[0], args.vary[1],
            ", ".join("%s = %s -> %s" % (args.vary[1], v, m) for v, m in varied)))
        failed |= not grows
    if not failed:
        print("ok    every code cell of %s ran and every chapter cell passed"
              % os.path.basename(path))
    print(json.dumps({"cells_s": {k: (round(v, 2) if v is not None else None)
                                  for k, v in times.items()}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
