#!/usr/bin/env bash
# Stage what the GPU tests need beyond ../shared/gpu/stage.sh, into ignored folders under .gpu/:
# Ray 2.60 and its dependencies as cp312 wheels (the Ray wheel, ~79 MB, split into four ~20 MB parts
# that ride along with the four TE parts, because one device call carries at most 64 MiB).
# A second Megatron-LM checkout for core_v0.19.0 goes to .gpu/mlm19 with the shared script:
#   bash ../shared/gpu/stage.sh --megatron-lm GIT_DIR core_v0.19.0 && mv .gpu/mlm .gpu/mlm19
# (then stage core_v0.16.1 again). Device calls: docs/gpu-results.md, "How to re-run".
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
rm -rf .gpu/raydeps .gpu/ray1 .gpu/ray2 .gpu/ray3 .gpu/ray4 && mkdir -p .gpu/raydeps .gpu/raydl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d .gpu/raydl ray==2.60.0
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d .gpu/raydeps click msgpack jsonschema jsonschema-specifications \
  referencing rpds-py attrs protobuf requests urllib3 idna certifi charset-normalizer pyyaml filelock packaging
wheel=$(ls .gpu/raydl/ray-2.60.0-*.whl)
basename "$wheel" >.gpu/raydeps/RAY_NAME
split -n 4 -d -a 1 "$wheel" .gpu/raypart
for i in 0 1 2 3; do mkdir -p ".gpu/ray$((i + 1))" && mv ".gpu/raypart$i" ".gpu/ray$((i + 1))/raypart$i"; done
du -sh .gpu/ray? .gpu/raydeps
