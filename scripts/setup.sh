#!/usr/bin/env bash
# Installs twinkle-specs and its test dependencies on a fresh CPU machine (Python 3.11).
# torch 2.13.0 is installed first, by itself, so pip takes the local CPU build rather than a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! $py -c 'import torch, sys; sys.exit(not torch.__version__.startswith(("2.11", "2.12", "2.13")))' 2>/dev/null; then
  $py -m pip install -q torch==2.13.0
fi
$py -m pip install -q -e ".[dev,ray,bench]"
# The Slurm launch tests need a real Slurm (Debian's slurm-wlm daemons + client); installed here, started by
# the tests (tests/launch/test_launch_slurm.py). Only the three packages the tests run, without the dozens of
# -dev/-plugin recommends of the slurm-wlm metapackage. Needs root; otherwise those tests skip and say why.
if ! PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client >/dev/null) \
      || echo "setup: could not install slurm-wlm (slurmctld slurmd slurm-client); the Slurm tests will skip" >&2
  else
    echo "setup: slurm-wlm is missing and apt-get/root is not available; the Slurm tests will skip" >&2
  fi
fi
