#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the CPU test suite. GPU tests skip themselves here.
# Set-up is the main job's (scripts/setup.sh), the dev/test extras, and two system packages for the
# launch-script tests: a real Slurm (Debian's slurm-wlm daemons + client, started by
# tests/launch/test_launch_slurm.py; only the three packages the tests run, without the dozens of
# -dev/-plugin recommends of the slurm-wlm metapackage) and shellcheck (the sbatch script's lint).
# Those need root and apt-get; otherwise the tests that use them skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
bash scripts/setup.sh
$py -m pip install -q -e ".[dev,ray,bench]"
missing=()
PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld slurmd slurm-client)
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null) \
      || echo "test: could not install ${missing[*]}; the tests that need them will skip" >&2
  else
    echo "test: ${missing[*]} missing and apt-get/root is not available; the tests that need them will skip" >&2
  fi
fi
$py -m ruff check .
$py -m pytest -q -rs "$@"
