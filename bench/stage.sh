#!/usr/bin/env bash
# Stages what the benchmark needs on the device machine beyond ../shared/gpu/stage.sh: matplotlib and
# its dependencies as Python 3.12 manylinux wheels (that machine has no network). numpy is not staged:
# the image's numpy satisfies matplotlib and must not be replaced under torch.
# Usage (from the project root, after ../shared/gpu/stage.sh):  bash bench/stage.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu/bench-whl
rm -rf "$dest" && mkdir -p "$dest"
pip download "matplotlib==3.10.9" --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" -q
rm -f "$dest"/numpy-*.whl
# the device machine's copy of the tree has no .git: record the commit and its sources' hash, which the
# run checks against the tree it measures (bench/provenance.py)
python3 bench/provenance.py > "$dest/COMMIT"
du -sh "$dest"
ls "$dest"
