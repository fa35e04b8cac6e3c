#!/usr/bin/env bash
# Stage what the GPU tests need beyond ../shared/gpu/stage.sh, into ignored folders under .gpu/:
# Ray 2.60 and its dependencies as cp312 wheels. The Ray wheel (~79 MB) goes in six ~13 MB parts, .gpu/r1 ..
# .gpu/r6, because one device call carries at most 64 MiB with the working tree: r1-r3 ride along with the
# TE parts p1-p3, r4-r6 and .gpu/raydeps go in a call of their own, then scripts/gpu/install_extras.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
rm -rf .gpu/raydeps .gpu/r[1-6] .gpu/raydl && mkdir -p .gpu/raydeps .gpu/raydl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d .gpu/raydl ray==2.60.0
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d .gpu/raydeps click msgpack jsonschema jsonschema-specifications \
  referencing rpds-py attrs protobuf requests urllib3 idna certifi charset-normalizer pyyaml filelock packaging
wheel=$(ls .gpu/raydl/ray-2.60.0-*.whl)
basename "$wheel" >.gpu/raydeps/RAY_NAME
split -n 6 -d -a 1 "$wheel" .gpu/raypart
for i in 0 1 2 3 4 5; do mkdir -p ".gpu/r$((i + 1))" && mv ".gpu/raypart$i" ".gpu/r$((i + 1))/raypart$i"; done
du -sh .gpu/r? .gpu/raydeps
