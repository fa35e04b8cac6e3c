#!/usr/bin/env bash
# The LoRA peers' wheel kits for the GPU machine, which has no network (see bench/peer_kits.py).
#   bash bench/peers.sh stage     here: the pinned wheels (cp312 manylinux) into .gpu/peers/<kit>/ (~53 MB);
#                                 carry [".gpu/peers"] in a device call
#   bash bench/peers.sh install   there, after the GPU stack (/tmp/gpu/env.sh): each staged kit into
#                                 /tmp/gpu/peers/<kit> (--no-index --no-deps --target), then an import check
# Kits: liger (Liger-Kernel, for the transformers + PEFT tunings), unsloth, mcore_bridge (ModelScope ms-swift
# on mcore-bridge, with the peft 0.20 both pin), megatron_bridge (NVIDIA Megatron-Bridge: megatron-core 0.19
# only; its transformers pin, <=5.12.1, is not met by the image's 5.17 and is skipped with --no-deps, which
# its import path tolerates), unsloth_fa4 (the FlashAttention-4 that Unsloth's switch reaches through torch's
# FA4 registry, which unpacks two values from _flash_attn_fwd: 4.0.0b18 is the newest release returning two; the
# CuTe DSL it runs on is twinkle's FA4 kit, scripts/gpu/stage_fa4.sh). Versions: the newest that accept the
# device's torch 2.11 / transformers 5.17.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A KITS=(
  [liger]="liger-kernel==0.8.5"
  [unsloth]="unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2"
  [mcore_bridge]="mcore-bridge==1.6.5 ms-swift==4.6.0 peft==0.20.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 modelscope==1.40.2 modelscope-hub==0.5.1 json-repair==0.64.6 cryptography==50.0.2 cffi==2.0.0"
  [megatron_bridge]="megatron-bridge==0.6.2 omegaconf==2.4.0"
  [unsloth_fa4]="flash-attn-4==4.0.0b18"
)

stage() {
  for kit in "${!KITS[@]}"; do
    dest=.gpu/peers/$kit
    rm -rf "$dest" && mkdir -p "$dest"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
      -d "$dest" ${KITS[$kit]}
  done
  # bitsandbytes (Unsloth imports it even for a 16-bit LoRA) ships native libraries for every CUDA, ROCm and
  # XPU: keep the one torch 2.11+cu130 loads and the CPU one (43 MB -> 3.6 MB; kept files byte-identical)
  wheel=$(ls .gpu/peers/unsloth/bitsandbytes-0.50.2-*.whl)
  python3 bench/slim_wheel.py "$wheel" cu130.slim 'bitsandbytes/libbitsandbytes_cuda1[0-2]*.so' \
    'bitsandbytes/libbitsandbytes_cuda132.so' 'bitsandbytes/libbitsandbytes_rocm*.so' \
    'bitsandbytes/libbitsandbytes_xpu*.so'
  rm "$wheel"
  du -sh .gpu/peers .gpu/peers/*
}

install() {
  # shellcheck disable=SC1091
  [ -f /tmp/gpu/env.sh ] && source /tmp/gpu/env.sh
  root=${BENCH_PEER_KITS:-/tmp/gpu/peers}
  for dir in .gpu/peers/*/; do
    kit=$(basename "$dir")
    rm -rf "${root:?}/$kit" && mkdir -p "$root/$kit"
    python -m pip install -q --no-index --no-deps --no-compile --target "$root/$kit" "$dir"*.whl
    echo "peer kit $kit: $(find "$dir" -name "*.whl" | wc -l) wheels in $root/$kit"
  done
  # import checks, each in its own process with only its kit first on the path (failures are reported,
  # not fatal: the benchmark records the variant as skipped with the reason)
  check liger "import liger_kernel.transformers"
  check unsloth "import os; os.environ.setdefault('HF_HUB_OFFLINE', '1'); import unsloth"
  check unsloth_fa4 "from importlib.metadata import version; import flash_attn.cute.interface; print('flash-attn-4', version('flash-attn-4'))"
  check mcore_bridge "import mcore_bridge, peft; from swift.megatron.utils import prepare_mcore_model; print('peft', peft.__version__)"
  check megatron_bridge "import megatron.core as c; from megatron.bridge import AutoBridge; print('megatron-core', c.__version__)"
}

check() {
  local kit=$1 code=$2 root=${BENCH_PEER_KITS:-/tmp/gpu/peers}
  [ -d "$root/$kit" ] || return 0
  if PYTHONPATH="$root/$kit:${PYTHONPATH:-}" python -c "$code" > "/tmp/peer-$kit.log" 2>&1; then
    echo "peer kit $kit: imports ($(tail -1 "/tmp/peer-$kit.log"))"
  else
    echo "peer kit $kit: import FAILED: $(tail -3 "/tmp/peer-$kit.log" | tr '\n' ' ')"
  fi
}

case "${1:-}" in
  stage) stage ;;
  install) install ;;
  *) echo "usage: bash bench/peers.sh stage|install" >&2; exit 2 ;;
esac
