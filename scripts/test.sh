#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the CPU test suite. GPU tests skip themselves here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m pytest -q -rs "$@"
