#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the CPU test suite on both supported megatron-core lines.
#   leg 0.16: this machine's python3 (Python 3.11) with megatron-core 0.16.1 (scripts/setup.sh) and the newest
#             transformers pyproject.toml allows;
#   leg 0.19: Python 3.12 in .venv-mcore019 with megatron-core 0.19.x, whose wheel also ships
#             megatron/training, so the tests against Megatron-LM's own parser and checkpoint loader run, and the
#             oldest transformers allowed.
# `--leg 0.16` or `--leg 0.19` runs one leg; other arguments go to pytest. GPU tests skip themselves here.
# Tests marked one_leg (pyproject.toml: the Slurm and Ray launch scripts' own mechanics and torch/Triton-only
# kernels, which exercise no megatron-core version-specific code, on leg 0.16; the benchmark harness, whose GPU
# runs use megatron-core 0.19, on leg 0.19) run on one leg only: each leg names itself in TWINKLE_TEST_LEG.
# pytest runs on PYTEST_WORKERS (default 2) pytest-xdist workers, each test module whole on one worker (its
# module fixtures start a cluster or one torchrun per world size once); 0 runs it in the pytest process.
# Set-up adds the dev/test extras and two system packages for the launch-script tests: a real Slurm
# (Debian's slurm-wlm daemons + client, started by tests/launch/test_launch_slurm.py; only the three
# packages the tests run, without the dozens of -dev/-plugin recommends of the slurm-wlm metapackage) and
# the shellcheck linter (for the sbatch script). Those need root and apt-get; otherwise the tests that use them
# skip and say why. Python 3.12 is $PYTHON312, else python3.12 on PATH, else pyenv's newest 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
legs=(0.16 0.19)
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --leg) legs=("$2"); shift 2;;
    *) pytest_args+=("$1"); shift;;
  esac
done
py=${PYTHON:-python3}
# On the 2-core CI machine much of a test's time is a subprocess starting up (imports) on one core.
workers=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
MCORE_019=0.19.2
# transformers at both ends of pyproject.toml's range: the newest release on leg 0.16 (the machine's python, so
# installed over what set-up left), the oldest in leg 0.19's own environment.
TRANSFORMERS_NEWEST=5.24.0
TRANSFORMERS_OLDEST=5.17.0

system_packages() {
  local missing=()
  PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld slurmd slurm-client)
  command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
  [ ${#missing[@]} -eq 0 ] && return
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null) \
      || echo "test: could not install ${missing[*]}; the tests that need them will skip" >&2
  else
    echo "test: ${missing[*]} missing and apt-get/root is not available; the tests that need them will skip" >&2
  fi
}

python312() {
  local candidate root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  # a pyenv shim is on PATH even where its version is not the selected one: take the first that runs
  # shellcheck disable=SC2012  # version folder names, newest last
  for candidate in "${PYTHON312:-}" "$(command -v python3.12 || true)" \
    "$(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1)"; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}

# Leg 0.19's environment: torch 2.11 from PyPI (the GPU machine's version; a CUDA build, run on the CPU here;
# its Triton 3.6 is the one the dev extra pins, where torch 2.13's CUDA build wants 3.7), megatron-core 0.19.x
# and this checkout, editable, with the same extras as leg 0.16.
setup_019() {
  local base venv=.venv-mcore019
  base=$(python312)
  if [ -z "$base" ]; then
    echo "test: leg 0.19 needs Python 3.12: set PYTHON312, or put python3.12 on PATH" >&2
    return 1
  fi
  [ -x "$venv/bin/python" ] || "$base" -m venv "$venv" >&2
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    "$venv/bin/python" -m pip install -q torch==2.11.0 >&2
  fi
  "$venv/bin/python" -m pip install -q "megatron-core==$MCORE_019" "transformers==$TRANSFORMERS_OLDEST" \
    -e ".[dev,ray,bench]" >&2
  echo "$venv/bin/python"
}

# The installed megatron-core and transformers, from their metadata (importing megatron.core takes seconds here).
versions() {
  "$1" -c 'from importlib.metadata import version as v; print("megatron-core", v("megatron-core"), "transformers", v("transformers"))'
}

system_packages
failed=()
for leg in "${legs[@]}"; do
  case "$leg" in
    0.16)
      TWINKLE_EXTRAS="[dev,ray,bench]" bash scripts/setup.sh  # one editable install, with the extras
      $py -m pip install -q "transformers==$TRANSFORMERS_NEWEST"
      $py -m ruff check .
      echo "== leg 0.16: $($py --version), $(versions "$py")"
      TWINKLE_TEST_LEG=0.16 $py -m pytest -q -rs "${workers[@]}" "${pytest_args[@]}" || failed+=(0.16)
      ;;
    0.19)
      py019=$(setup_019)
      echo "== leg 0.19: $($py019 --version), $(versions "$py019")"
      TWINKLE_TEST_LEG=0.19 $py019 -m pytest -q -rs "${workers[@]}" "${pytest_args[@]}" || failed+=(0.19)
      ;;
    *) echo "test: unknown leg $leg (0.16 or 0.19)" >&2; exit 2;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test: failed on leg(s) ${failed[*]}" >&2
  exit 1
fi
