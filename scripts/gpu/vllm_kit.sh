#!/usr/bin/env bash
# vLLM for the GPU tests that serve twinkle's exported adapters (tests/test_vllm_gpu.py). The device machine
# has no network and takes at most 64 MiB per call, so the kit travels as chunks of one archive.
#   bash scripts/gpu/vllm_kit.sh stage     here: the wheels pinned in scripts/gpu/vllm-kit.txt (cp312 manylinux,
#                                          no torch: vLLM 0.26.0 is the newest release for the device's torch
#                                          2.11) into one tar, split into .gpu/vllm/cN/ (48 MB each, ~8 of them)
#   (device calls) carry [".gpu/vllm/cN"], run: mkdir -p /tmp/gpu/vllm-chunks && cp .gpu/vllm/cN/* /tmp/gpu/vllm-chunks/
#   bash scripts/gpu/vllm_kit.sh install   there, after the GPU stack: the chunks joined and the wheels installed
#                                          into /tmp/gpu/vllm (--target, not the image's site-packages: the
#                                          tests put it first on the path of vLLM's process only), then an import check
# The list is vLLM's import closure on Python 3.12 (found by importing vllm, its LoRA manager, the Qwen3 and
# Qwen3-MoE models and its GPU worker with only these wheels added to torch 2.11); vLLM's optional kernels
# (flashinfer, tilelang, cutlass-dsl, its own triton 3.9) are left out: with enforce_eager it runs on torch's,
# and tests/vllm_worker.py turns its FlashInfer sampler off (VLLM_USE_FLASHINFER_SAMPLER=0).
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.gpu/vllm
chunk_mb=48

stage() {
  rm -rf "$kit" && mkdir -p "$kit/dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux_2_5_x86_64 \
    -d "$kit/dl" -r scripts/gpu/vllm-kit.txt
  tar -C "$kit/dl" -cf "$kit/kit.tar" .
  split -b "${chunk_mb}M" -d -a 2 "$kit/kit.tar" "$kit/part."
  local i=0
  for part in "$kit"/part.*; do
    i=$((i + 1))
    mkdir -p "$kit/c$i" && mv "$part" "$kit/c$i/"
  done
  sha256sum "$kit/kit.tar" | cut -d' ' -f1 > "$kit/c1/SHA256"
  rm -rf "$kit/dl" "$kit/kit.tar"
  echo "vLLM kit: $i chunks, carry each: $(cd "$kit" && echo c*)"
}

install() {
  # shellcheck disable=SC1091  # written on the device machine by ../shared/gpu/install.sh
  [ -f /tmp/gpu/env.sh ] && source /tmp/gpu/env.sh
  local chunks=/tmp/gpu/vllm-chunks dest=/tmp/gpu/vllm
  cat "$chunks"/part.* > /tmp/gpu/vllm-kit.tar
  if [ "$(sha256sum /tmp/gpu/vllm-kit.tar | cut -d' ' -f1)" != "$(cat "$chunks/SHA256")" ]; then
    echo "vLLM kit: the joined chunks do not match the staged archive (a chunk missing?): $(ls "$chunks")" >&2
    exit 1
  fi
  rm -rf /tmp/gpu/vllm-wheels "$dest" && mkdir -p /tmp/gpu/vllm-wheels
  tar -C /tmp/gpu/vllm-wheels -xf /tmp/gpu/vllm-kit.tar
  python -m pip install -q --no-index --no-deps --no-compile --target "$dest" /tmp/gpu/vllm-wheels/*.whl
  PYTHONPATH=$dest${PYTHONPATH:+:$PYTHONPATH} python -c \
    "import vllm; from vllm.lora.request import LoRARequest; print('vLLM', vllm.__version__, 'in $dest')"
}

case "${1:-}" in
  stage) stage ;;
  install) install ;;
  *)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
