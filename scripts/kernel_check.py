#!/usr/bin/env python3
"""Checks the "Rust (workbook)" Jupyter kernel through Jupyter itself.

Installs the kernel spec (`workbook kernel install`) into a temporary
Jupyter data folder, starts the kernel with jupyter_client, and runs cells
in it: a 1000 x 1000 f32 candle tensor made in one cell moves the
parameters' count by exactly its 4,000,000 bytes of data (the same tensor
bookkeeping as a 1 x 1000 one), and dropping it in a later cell charges it
back. Prints the kernel's start time, the first cell's (which builds the
crates) and a warm cell's.

    python3 scripts/kernel_check.py --workbook target/release/workbook

Needs jupyter_client (pip install jupyter_client ipykernel) and
evcxr_jupyter (cargo install --locked evcxr_jupyter). Exit status 0 when
every check holds, 1 when one fails, 2 when something is missing.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workbook", required=True, help="the workbook executable")
    ap.add_argument("--preload", help="the interposer [default: beside the workbook executable]")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a cell may take")
    args = ap.parse_args()
    try:
        from jupyter_client.manager import start_new_kernel
    except ImportError:
        print("error: jupyter_client is not installed: pip install jupyter_client ipykernel",
              file=sys.stderr)
        return 2

    data = tempfile.mkdtemp(prefix="workbook-kernel-")
    spec_dir = os.path.join(data, "kernels", "rust-workbook")
    install = [args.workbook, "kernel", "install", "--dir", spec_dir]
    if args.preload:
        install += ["--preload", args.preload]
    done = subprocess.run(install, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr.strip(), file=sys.stderr)
        return 2
    os.environ["JUPYTER_PATH"] = data

    sdk = os.path.join(REPO, "crates", "sdk")
    cells = [
        # Compiled crates kept between kernel sessions (up to 500 MiB); the
        # meter without candle, candle for the tensor.
        ":cache 500\n"
        ':dep workbook-sdk = { path = "%s", default-features = false }\n'
        ':dep candle-core = "0.11.1"\n' % sdk,
        "use workbook_sdk::meter::{Category, KernelMeter, Meter};\n"
        "use candle_core::{DType, Device, Tensor};\n"
        "fn params() -> u64 {\n"
        "    let meter = KernelMeter::new().expect(\"the interposer counts this kernel\");\n"
        "    meter.snapshot().current.get(Category::Parameters)\n"
        "}\n"
        "let base = params();\n"
        'println!("meter ready");',
        "let small = Category::Parameters.scope(|| Tensor::zeros((1, 1000), DType::F32, &Device::Cpu)).unwrap();\n"
        "let with_small = params() - base;\n"
        "let big = Category::Parameters.scope(|| Tensor::zeros((1000, 1000), DType::F32, &Device::Cpu)).unwrap();\n"
        'println!("{} {}", with_small, params() - base - with_small);',
        "drop(big);\n"
        "drop(small);\n"
        'println!("{}", params() - base);',
    ]

    started = time.monotonic()
    km, kc = start_new_kernel(kernel_name="rust-workbook", startup_timeout=120)
    kernel_start = time.monotonic() - started
    outputs, seconds = [], []
    failed = False
    try:
        for source in cells:
            t = time.monotonic()
            text, error = [], None

            def hook(msg):
                nonlocal error
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    text.append(content["text"])
                elif kind == "error":
                    error = "\n".join(content.get("traceback", [])) or content.get("evalue")

            reply = kc.execute_interactive(source, timeout=args.timeout, output_hook=hook)
            seconds.append(time.monotonic() - t)
            if reply["content"]["status"] != "ok" or error:
                print("error: a cell failed:\n%s\n%s\n%s"
                      % (source, "".join(text), error or reply["content"]), file=sys.stderr)
                return 1
            outputs.append("".join(text).strip())
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    small, big = (int(x) for x in outputs[2].split())
    after = int(outputs[3])
    checks = [
        ("a 1 x 1000 f32 tensor: 4,000 bytes of data and its bookkeeping",
         4000 <= small < 4000 + 1024, small),
        ("a 1000 x 1000 f32 tensor made in a cell: exactly 4,000,000 bytes more than the small one's 4,000",
         big == small + 3_996_000, big),
        ("both dropped in a later cell: charged back to parameters", after == 0, after),
    ]
    for what, ok, value in checks:
        print("%s  %s (measured %d bytes)" % ("ok  " if ok else "FAIL", what, value))
        failed |= not ok
    print(json.dumps({
        "kernel_start_s": round(kernel_start, 2),
        "first_cell_s": round(seconds[0], 2),
        "cells_s": [round(s, 2) for s in seconds],
    }))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
