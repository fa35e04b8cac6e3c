#!/usr/bin/env bash
# Stage FlashAttention-4 (the flash-attn-4 extra: twinkle_specs.flash_attention, --flash-attn-4) for the GPU
# machine, which has no network: cp312 wheels into ignored folders under .gpu/. The CuTe DSL's CUDA 13 library
# wheel (~92 MB) goes in two halves, .gpu/fa4a and .gpu/fa4b, the rest in .gpu/fa4c (~18 MB): one device call
# carries at most 64 MiB. Carry each in a call of its own that copies it to /tmp/gpu/fa4, then
# scripts/gpu/install_fa4.sh there. The versions are the flash-attn-4 extra's (pyproject.toml); cuda-bindings
# and einops come with the machine's torch image.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
rm -rf .gpu/fa4a .gpu/fa4b .gpu/fa4c .gpu/fa4dl && mkdir -p .gpu/fa4a .gpu/fa4b .gpu/fa4c .gpu/fa4dl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d .gpu/fa4c flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 "apache-tvm-ffi==0.1.15.post2" \
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d .gpu/fa4dl nvidia-cutlass-dsl-libs-cu13==4.8.1
wheel=$(ls .gpu/fa4dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
basename "$wheel" >.gpu/fa4c/CU13_NAME
split -n 2 -d -a 1 "$wheel" .gpu/fa4dl/part
mv .gpu/fa4dl/part0 .gpu/fa4a/cu13part0 && mv .gpu/fa4dl/part1 .gpu/fa4b/cu13part1 && rm -rf .gpu/fa4dl
du -sh .gpu/fa4a .gpu/fa4b .gpu/fa4c
