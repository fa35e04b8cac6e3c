#!/usr/bin/env bash
# Runs ON the GPU machine after ../shared/gpu/install.sh, with .gpu/bench-whl and (optional) .gpu/mlm19
# carried and the Ray parts (.gpu/r1 .. .gpu/r6) and .gpu/raydeps already copied to /tmp/gpu by earlier calls
# (scripts/gpu/stage_extras.sh).
# Installs Ray and matplotlib into the machine's Python and writes /tmp/gpu/env19.sh, which runs
# against the core_v0.19.0 checkout (its megatron/core shadows the 0.16.1 wheel) instead of core_v0.16.1.
set -euo pipefail
name=$(cat /tmp/gpu/raydeps/RAY_NAME)
cat /tmp/gpu/raypart0 /tmp/gpu/raypart1 /tmp/gpu/raypart2 /tmp/gpu/raypart3 /tmp/gpu/raypart4 /tmp/gpu/raypart5 \
  >"/tmp/gpu/raydeps/$name"
python3 -m pip install -q --no-index --find-links /tmp/gpu/raydeps "ray==2.60.0"
python3 -m pip install -q --no-index --find-links .gpu/bench-whl matplotlib
if [ -d .gpu/mlm19 ]; then
  rm -rf /tmp/gpu/mlm19 && cp -r .gpu/mlm19 /tmp/gpu/mlm19
  sed 's#/tmp/gpu/mlm#/tmp/gpu/mlm19#g' /tmp/gpu/env.sh >/tmp/gpu/env19.sh
fi
python3 -c "import ray, matplotlib; print('extras ok: ray', ray.__version__, 'matplotlib', matplotlib.__version__)"
