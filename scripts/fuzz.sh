#!/usr/bin/env bash
# Fuzzes the chapter loader and validator with libFuzzer (cargo-fuzz): any
# text may be refused, none may crash the process.
#
#   scripts/fuzz.sh                       a 60-second run (what CI does)
#   scripts/fuzz.sh -runs=1000000         a million inputs
#   scripts/fuzz.sh -max_total_time=600   any of libFuzzer's options
#   scripts/fuzz.sh --build               cargo-fuzz and the target built, no run
#
# The corpus starts from the chapters and the test fixtures and grows in
# ~/.cache/workbook/fuzz-corpus (WORKBOOK_FUZZ_CORPUS); a crash is written to
# fuzz/artifacts/chapter/ and makes the script fail. cargo-fuzz needs
# nightly's -Z flags: RUSTC_BOOTSTRAP lets the stable toolchain accept them.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
fi

corpus="${WORKBOOK_FUZZ_CORPUS:-$HOME/.cache/workbook/fuzz-corpus}"
mkdir -p "$corpus"
cp chapters/*.toml tests/fixtures/*.toml "$corpus/"

export RUSTC_BOOTSTRAP=1
target="${WORKBOOK_FUZZ_TARGET:-$HOME/.cache/workbook/target-fuzz}"
if [ "${1:-}" = --build ]; then
  exec cargo fuzz build --sanitizer none --target-dir "$target" chapter
fi
if [ "$#" -eq 0 ]; then
  set -- -max_total_time=60
fi
# No sanitizer: the loader is safe Rust, and what is looked for is a panic,
# an abort or a stack overflow, which libFuzzer catches on its own.
cargo fuzz run --sanitizer none --target-dir "$target" chapter "$corpus" -- \
  -max_len=65536 -timeout=10 "$@"
