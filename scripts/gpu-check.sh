#!/usr/bin/env bash
# Every GPU check in one command, for a GPU machine reached for a few
# minutes: the meter's test, chapters 2 and 3 on the card, PyTorch's side of
# the comparison, the planner verified on the card, and the comparison
# written as Markdown. Run from the source tree's root, with the folder that
# scripts/gpu-pack.sh made (gpu-pack/) beside it:
#
#   scripts/gpu-check.sh --out DIR        on the GPU machine
#   scripts/gpu-check.sh --dry-run        here, on the CPU: the same steps at
#                                         check size with --device cpu, the
#                                         packed binaries against the stand-in
#                                         driver (what CI runs)
#
# gpu-pack/ is not tracked by git: a copy of the tree made for the GPU
# machine must carry it.
#
# Each step has its own time limit, so a hang costs only its share; the
# limits, with each step's grace to stop, add up to at most 7 minutes (a
# minute of the 8 is left for the rest). Everything lands in DIR (default
# $OUT): gpu-check.log (every step's output), comparison-gpu.md (the tables,
# from scripts/gpu_report.py, written anew after every step, so that a run
# cut short keeps what it measured) and results.tar.gz (each step's files).
# Exit status: 0 when every step passed or was skipped for a reason it
# names, 1 when a step failed, 2 for a bad command line or a missing pack.
#
# Environment: WORKBOOK_GPU_PACK (default gpu-pack), WORKBOOK_TORCH_PYTHON
# (the Python that has PyTorch; default python3), WORKBOOK_CUDA_CACHE (for
# --dry-run: where scripts/build-cuda.sh keeps the wheels and the stand-in
# driver; default ~/.cache/workbook/cuda).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

dry=0
out="${OUT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out)
      out="${2:-}"
      shift
      ;;
    *)
      echo "usage: $0 [--dry-run] [--out DIR]" >&2
      exit 2
      ;;
  esac
  shift
done
if [ -z "$out" ]; then
  if [ "$dry" -eq 1 ]; then
    out="$(mktemp -d)"
  else
    echo "error: give --out DIR (or set OUT): where the results go" >&2
    exit 2
  fi
fi
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
# Each step's files, packed into one archive at the end (a results folder
# of a few files travels better than dozens).
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results="$work/results"
mkdir -p "$results"
log="$out/gpu-check.log"
: >"$log"

pack="${WORKBOOK_GPU_PACK:-gpu-pack}"
if [ ! -f "$pack/binaries.tar.xz" ]; then
  echo "error: $pack/binaries.tar.xz is missing; run scripts/gpu-pack.sh first (and carry $pack)" >&2
  exit 2
fi
mkdir -p "$work/bin"
tar xJf "$pack/binaries.tar.xz" -C "$work/bin" 2>/dev/null ||
  python3 -m tarfile -e "$pack/binaries.tar.xz" "$work/bin" || {
  echo "error: $pack/binaries.tar.xz could not be unpacked" >&2
  exit 2
}
bin="$work/bin/workbook-cuda"
meter_test="$work/bin/cuda-meter-test"
python="${WORKBOOK_TORCH_PYTHON:-python3}"
# What the steps' functions read, in the shells they run in.
export bin meter_test pack python results cuda_lib

# The CUDA libraries: PyTorch's on the GPU machine; for the dry run, the
# wheels scripts/build-cuda.sh installed and its stand-in driver.
if [ "$dry" -eq 1 ]; then
  cache="${WORKBOOK_CUDA_CACHE:-$HOME/.cache/workbook/cuda}"
  cuda_lib="$("$cache/venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)" || {
    echo "error: no CUDA wheels in $cache/venv; run scripts/build-cuda.sh check first" >&2
    exit 2
  }
  export LD_LIBRARY_PATH="$cache/lib/fake:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export WORKBOOK_FAKE_DRIVER=1
  device=cpu
  size=(--check)
  export device
  scale=3 # the CPU at check size is slower than the card at full size
else
  # PyTorch's CUDA 13 wheels (the nvidia namespace package may span several
  # folders), else the toolkit's own libraries.
  cuda_lib="$("$python" -c 'import glob, nvidia, os
found = [d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "cu13", "lib")) if glob.glob(os.path.join(d, "libcublas.so.13*"))]
print(found[0] if found else "")' 2>/dev/null)" || cuda_lib=""
  if [ -z "$cuda_lib" ] && ls /usr/local/cuda/lib64/libcublas.so.13* >/dev/null 2>&1; then
    cuda_lib=/usr/local/cuda/lib64
  fi
  if [ -n "$cuda_lib" ] && [ -d "$cuda_lib" ]; then
    export LD_LIBRARY_PATH="$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    echo "warning: no CUDA 13 libraries under PyTorch's nvidia package (${cuda_lib:-none found}); the workbook's steps need libcublas.so.13 and libcurand.so.10 on LD_LIBRARY_PATH" | tee -a "$log"
  fi
  export WORKBOOK_REQUIRE_GPU=1
  device=cuda
  size=()
  export device
  scale=1
fi
export PYTHONUNBUFFERED=1

have_torch=1
torch_missing=""
if ! torch_missing="$("$python" -c 'import torch' 2>&1)"; then
  have_torch=0
  torch_missing="$(printf '%s' "$torch_missing" | tail -n 1)"
fi
export have_torch torch_missing

# name, limit in seconds. The comparison's steps first: what a cut-short
# run has already measured stays in results.tar.gz. On an H200 (Nov 2026)
# the meter took 13 s, chapter 2 20 s, PyTorch's side 12 s, the GPT's plans
# 4 s (all in one process then), PyTorch's GPT 17 s, chapter 3 6 s.
limits=(
  info 10
  meter 30
  chapter2 75
  torch-chapter2 50
  gpt 50
  torch-gpt 35
  chapter3 50
  plan-verify 40
)
# After its limit a step has this long to stop (the runner stops its
# workers, up to 5 s, and then prints what its cells measured).
grace=10
# The limits and graces within 8 minutes, less a minute for the rest
# (unpacking, the torch probe, the archives and reports between steps).
total=0
for ((i = 1; i < ${#limits[@]}; i += 2)); do total=$((total + limits[i] + grace)); done
if [ "$total" -gt 420 ]; then
  echo "error: the steps' limits and graces add up to $total s, more than 7 minutes" >&2
  exit 2
fi
limit_of() {
  for ((i = 0; i < ${#limits[@]}; i += 2)); do
    if [ "${limits[i]}" = "$1" ]; then
      echo $((limits[i + 1] * scale))
      return
    fi
  done
  echo "error: no limit for step $1" >&2
  exit 2
}

failed=0
printf 'step\tstatus\tseconds\tlimit\n' >"$results/summary.tsv"
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$results/summary.tsv"; }

# step NAME COMMAND...: runs COMMAND within NAME's limit, its output into
# results/NAME.out and the log.
step() {
  local name="$1" limit start status seconds
  shift
  limit="$(limit_of "$name")"
  printf '\n== %s (limit %s s): %s\n' "$name" "$limit" "$*" | tee -a "$log"
  start=$(date +%s%N)
  if declare -F "$1" >/dev/null; then
    # A function of this script: run in a shell of its own, so that the
    # limit can stop it.
    timeout --kill-after="$grace" "$limit" bash -c "$(declare -f); $*" \
      >"$results/$name.out" 2>"$results/$name.err"
  else
    timeout --kill-after="$grace" "$limit" "$@" >"$results/$name.out" 2>"$results/$name.err"
  fi
  status=$?
  seconds=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  tail -c 4000 "$results/$name.err" >>"$log"
  if [ "$status" -eq 0 ]; then
    record "$name" passed "$seconds" "$limit"
  elif [ "$status" -eq 1 ] && [ "${chapter:-0}" -eq 1 ]; then
    # The run is whole and its report says which assertions failed.
    record "$name" "ran; assertions failed (see its report)" "$seconds" "$limit"
    failed=1
  elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    record "$name" "stopped at its limit" "$seconds" "$limit"
    failed=1
  else
    record "$name" "failed ($status)" "$seconds" "$limit"
    failed=1
  fi
  echo "-- $name: $(tail -n 1 "$results/summary.tsv" | cut -f2) in $seconds s" | tee -a "$log"
  # What is measured so far, kept even if the machine is taken away later.
  tar czf "$out/results.tar.gz" -C "$work" results
  report
}
# The comparison as far as it goes; false when the report cannot be made.
report() {
  if python3 scripts/gpu_report.py "$results" >"$out/comparison-gpu.md.new"; then
    mv "$out/comparison-gpu.md.new" "$out/comparison-gpu.md"
  else
    rm -f "$out/comparison-gpu.md.new"
    return 1
  fi
}
skip() {
  record "$1" "skipped: $2" 0 "$(limit_of "$1")"
  printf '\n== %s skipped: %s\n' "$1" "$2" | tee -a "$log"
}

# shellcheck disable=SC2329 # the steps below run these functions by name
info() {
  date -u
  uname -srm
  echo "workbook: $("$bin" --version) ($(cat "$pack/MANIFEST" 2>/dev/null | tr '\n' ' '))"
  echo "CUDA libraries: ${cuda_lib:-none} (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})"
  # Which of them the binary found, and any it did not.
  ldd "$bin" | grep -E 'cuda|cublas|curand|nvrtc|not found' | sed 's/ (0x[0-9a-f]*)$//'
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  else
    echo "no nvidia-smi"
  fi
  if [ "$have_torch" -eq 1 ]; then
    "$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU", torch.cuda.is_available())'
  else
    echo "no PyTorch: $torch_missing"
  fi
}
# The GPT step's peaks on the workbook's side, as `plan` calibrates them:
# one process a recipe and dtype, so that one that fails costs only its own
# row; the step fails if any did.
gpt_both() {
  local status=0 dtype recipe
  for dtype in f32 bf16; do
    for recipe in candle lean tiled direct direct_tiled; do
      "$bin" plan --device "$device" --budget 64GiB --batch 4 --dtypes "$dtype" --no-checkpointing \
        --recipes "$recipe" --json >"$results/gpt-$dtype-$recipe.json" || {
        echo "the $recipe recipe in $dtype failed" >&2
        status=1
      }
    done
  done
  return "$status"
}
torch_gpt_both() {
  # Five steps after the first, whose median is compared.
  "$python" scripts/torch_gpt.py --device "$device" --dtype f32 --steps 6 >"$results/torch-gpt-f32.json" &&
    "$python" scripts/torch_gpt.py --device "$device" --dtype bf16 --steps 6 >"$results/torch-gpt-bf16.json"
}

step info info
# The meter's test runs the packed workbook where it needs the binary.
WORKBOOK_BIN="$bin" step meter "$meter_test"
# A per-cell limit inside the step's own, so one hung cell loses only itself.
chapter=1 step chapter2 "$bin" run chapter2 ${size[@]+"${size[@]}"} --device "$device" --format json --timeout 40
cp "$results/chapter2.out" "$results/chapter2.json"
if [ "$have_torch" -eq 1 ]; then
  step torch-chapter2 "$python" scripts/torch_chapter2.py ${size[@]+"${size[@]}"} --device "$device"
  cp "$results/torch-chapter2.out" "$results/torch-chapter2.json"
else
  skip torch-chapter2 "no PyTorch ($torch_missing)"
fi
step gpt gpt_both
if [ "$have_torch" -eq 1 ]; then
  step torch-gpt torch_gpt_both
else
  skip torch-gpt "no PyTorch ($torch_missing)"
fi
chapter=1 step chapter3 "$bin" run chapter3 ${size[@]+"${size[@]}"} --device "$device" --format json --timeout 40
cp "$results/chapter3.out" "$results/chapter3.json"
step plan-verify "$bin" plan --device "$device" --budget 3GiB --batch 8 --dtypes f32,bf16 --verify --steps 1 --json
cp "$results/plan-verify.out" "$results/plan-verify.json"

report || failed=1
tar czf "$out/results.tar.gz" -C "$work" results
printf '\n== summary\n' | tee -a "$log"
tee -a "$log" <"$results/summary.tsv"
echo "written: $out/gpu-check.log, $out/comparison-gpu.md, $out/results.tar.gz" | tee -a "$log"
exit "$failed"
