#!/usr/bin/env bash
# Installs twinkle-specs and its test dependencies on a fresh CPU machine (Python 3.11).
# torch 2.13.0 is installed first, by itself, so pip takes the local CPU build rather than a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! $py -c 'import torch, sys; sys.exit(not torch.__version__.startswith(("2.11", "2.12", "2.13")))' 2>/dev/null; then
  $py -m pip install -q torch==2.13.0
fi
$py -m pip install -q -e ".[dev,ray]"
# The Slurm launch tests need a real Slurm (Debian's slurm-wlm); installed here, started by the tests.
if ! command -v slurmctld >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null) \
    || echo "setup: could not install slurm-wlm; the Slurm tests will be skipped with that reason" >&2
fi
