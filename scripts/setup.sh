#!/usr/bin/env bash
# Installs what the main job (scripts/run.sh) needs on a fresh CPU machine (Python 3.11): twinkle-specs and
# its dependencies. The test command (scripts/test.sh) adds the test extras (TWINKLE_EXTRAS) and system packages.
# torch 2.13.0 is installed first, by itself, so pip takes the local CPU build rather than a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! $py -c 'import torch, sys; sys.exit(not torch.__version__.startswith(("2.11", "2.12", "2.13")))' 2>/dev/null; then
  $py -m pip install -q torch==2.13.0
fi
# TWINKLE_EXTRAS (e.g. "[dev,ray,bench]", what scripts/test.sh passes) adds extras to the same install.
$py -m pip install -q -e ".${TWINKLE_EXTRAS:-}"
