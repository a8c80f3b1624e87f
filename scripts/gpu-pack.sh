#!/usr/bin/env bash
# Makes everything scripts/gpu-check.sh needs on a GPU machine that has a
# driver, CUDA's libraries and PyTorch but no Rust toolchain: the CUDA build
# of the workbook and the meter's GPU test, stripped and compressed with xz
# (the embedded PTX is text: the dev build's 108 MB become 15), in
# gpu-pack/binaries.tar.xz, beside the source tree (chapters and scripts)
# that goes with it. Then checks that the source tree and the pack together
# stay under 64 MiB, and that the packed binary starts.
#
#   scripts/gpu-pack.sh          release build (for the GPU run)
#   scripts/gpu-pack.sh --dev    dev-profile build (for CI's dry run: it
#                                reuses what `scripts/build-cuda.sh check` built)
#
# On the GPU machine, from the source tree with gpu-pack/ in it:
#   scripts/gpu-check.sh --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."

mode=build
case "${1:-}" in
  "") ;;
  --dev) mode=build-dev ;;
  *)
    echo "usage: $0 [--dev]" >&2
    exit 2
    ;;
esac

# What gpu-check.sh reads from the source tree; it must be tracked or
# otherwise travel with it.
needed=(scripts/gpu-check.sh scripts/gpu_report.py scripts/compare.py
  scripts/torch_required.py scripts/torch_chapter2.py scripts/torch_gpt.py chapters/chapter2.toml chapters/chapter3.toml)
for f in "${needed[@]}"; do
  [ -f "$f" ] || {
    echo "error: $f is missing" >&2
    exit 1
  }
done

bash scripts/build-cuda.sh "$mode"

pack=gpu-pack
rm -rf "$pack"
mkdir -p "$pack"
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
for f in workbook-cuda cuda-meter-test; do
  # Debug info is of no use there and most of the size.
  strip -o "$staging/$f" "dist/$f"
done
tar cJf "$pack/binaries.tar.xz" -C "$staging" workbook-cuda cuda-meter-test
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+changes')"
  echo "profile $([ "$mode" = build ] && echo release || echo dev)"
  echo "compute capability ${CUDA_COMPUTE_CAP:-90}"
} >"$pack/MANIFEST"

# The binaries must at least start here, against the stand-in driver.
cache="${WORKBOOK_CUDA_CACHE:-$HOME/.cache/workbook/cuda}"
cuda_lib="$("$cache/venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')"
LD_LIBRARY_PATH="$cache/lib/fake:$cuda_lib" "$staging/workbook-cuda" --version

# What travels: the files git tracks or would track, and the pack.
tree_bytes="$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -n 1 | cut -f1)"
pack_bytes="$(du -cb "$pack" | tail -n 1 | cut -f1)"
total=$((tree_bytes + pack_bytes))
limit=$((64 * 1024 * 1024))
printf 'source tree %.1f MiB + %s %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
  "$(echo "$tree_bytes / 1048576" | awk '{print $1 / $3}')" "$pack" \
  "$(echo "$pack_bytes / 1048576" | awk '{print $1 / $3}')" \
  "$(echo "$total / 1048576" | awk '{print $1 / $3}')"
if [ "$total" -gt "$limit" ]; then
  echo "error: the source tree and the pack take $total bytes, more than 64 MiB" >&2
  exit 1
fi
cat "$pack/MANIFEST"
