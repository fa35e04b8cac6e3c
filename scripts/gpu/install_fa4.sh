#!/usr/bin/env bash
# Runs ON the GPU machine, with .gpu/fa4a's, .gpu/fa4b's and .gpu/fa4c's files copied to /tmp/gpu/fa4 by
# earlier calls, or .gpu/fa4c carried in this one (scripts/gpu/stage_fa4.sh): installs FlashAttention-4 into
# the machine's Python.
set -euo pipefail
mkdir -p /tmp/gpu/fa4
if [ -d .gpu/fa4c ]; then cp .gpu/fa4c/* /tmp/gpu/fa4/; fi
cd /tmp/gpu/fa4
cat cu13part0 cu13part1 >"$(cat CU13_NAME)"
python -m pip install -q --no-index --no-deps ./*.whl
python -c "import flash_attn.cute; from importlib.metadata import version as v; print('flash-attn-4 ok:', v('flash-attn-4'))"
