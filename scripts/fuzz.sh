#!/usr/bin/env bash
# Fuzzes what reads a user's files with libFuzzer (cargo-fuzz): any text
# may be refused, none may crash the process. Two targets: `chapter`, the
# chapter loader and validator (the default), and `config`, a decoder's
# config.json read and planned.
#
#   scripts/fuzz.sh                       the chapter loader for 60 seconds
#   scripts/fuzz.sh config                a config.json for 60 seconds
#   scripts/fuzz.sh chapter -runs=1000000 a million chapters
#   scripts/fuzz.sh -max_total_time=600   any of libFuzzer's options
#   scripts/fuzz.sh --build               cargo-fuzz and both targets built, no run
#   scripts/fuzz.sh config CRASH-FILE     one saved input rerun
#
# Each target's corpus starts from the files it reads (the chapters and the
# test fixtures; the published configs in models/) and grows in
# ~/.cache/workbook/fuzz-corpus (the chapter's) or fuzz-corpus-config
# (WORKBOOK_FUZZ_CORPUS names another for the target run); a crash is
# written to fuzz/artifacts/<target>/ and makes the script fail. cargo-fuzz
# needs nightly's -Z flags: RUSTC_BOOTSTRAP lets the stable toolchain accept
# them.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
fi

export RUSTC_BOOTSTRAP=1
target="${WORKBOOK_FUZZ_TARGET:-$HOME/.cache/workbook/target-fuzz}"
if [ "${1:-}" = --build ]; then
  exec cargo fuzz build --sanitizer none --target-dir "$target"
fi

fuzzed=chapter
case "${1:-}" in
  chapter | config)
    fuzzed="$1"
    shift
    ;;
  # libFuzzer's options, or an input file to rerun (a crash it saved).
  -* | "") ;;
  *)
    if [ ! -f "$1" ]; then
      echo "error: \`$1\` is neither a fuzz target (chapter, config) nor an input file" >&2
      exit 2
    fi
    ;;
esac
for arg in "$@"; do
  if [ "$arg" = --build ]; then
    echo "error: --build builds both targets: give it alone, first" >&2
    exit 2
  fi
done

case "$fuzzed" in
  chapter) kept="$HOME/.cache/workbook/fuzz-corpus" ;;
  config) kept="$HOME/.cache/workbook/fuzz-corpus-config" ;;
esac
corpus="${WORKBOOK_FUZZ_CORPUS:-$kept}"
mkdir -p "$corpus"
case "$fuzzed" in
  chapter) cp chapters/*.toml tests/fixtures/*.toml "$corpus/" ;;
  config) cp models/*.json "$corpus/" ;;
esac

if [ "$#" -eq 0 ]; then
  set -- -max_total_time=60
fi
# No sanitizer: the readers are safe Rust, and what is looked for is a
# panic, an abort or a stack overflow, which libFuzzer catches on its own.
cargo fuzz run --sanitizer none --target-dir "$target" "$fuzzed" "$corpus" -- \
  -max_len=65536 -timeout=10 "$@"
