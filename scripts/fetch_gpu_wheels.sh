#!/usr/bin/env bash
# Download the wheels of scripts/gpu_wheels.txt into .whl/ (ignored by git) for CPython 3.12 on
# x86-64 Linux, so that scripts/gpu_check.sh can install them on a GPU machine with no network.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^#' scripts/gpu_wheels.txt | grep . | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$req" || { echo "could not fetch $req" >&2; exit 1; }
done
du -sh .whl
