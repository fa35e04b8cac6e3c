#!/usr/bin/env bash
# The main job on an embedded default: build a small Qwen3 from the bundled config with random weights,
# save it as a Hugging Face checkpoint, load it into megatron-core through qwen_layer_spec and print the
# parity report against transformers. Pass --hf-model DIR to use your own checkpoint instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" -m twinkle_specs.cli parity "$@"
