"""Against stock Megatron-LM: our flags parse with its own parser (megatron.training, from megatron-core
0.19's wheel or a checkout), and pretrain_gpt.py trains with ``--spec twinkle_specs qwen_layer_spec``
(needs a checkout in $MEGATRON_LM_ROOT, never vendored here, and a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import megatron_training_root, torchrun

import twinkle_specs as ts

ROOT = os.environ.get("MEGATRON_LM_ROOT")
TRAINING = megatron_training_root()


@pytest.mark.skipif(
    not TRAINING,
    reason="needs megatron.training: megatron-core 0.19+ (its wheel ships it; the Python 3.12 CI leg) "
    "or a stock Megatron-LM checkout in $MEGATRON_LM_ROOT",
)
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_flags_parse_with_megatron_lm_parser(kind, checkpoints):
    flags = ts.megatron_args_from_hf(checkpoints(kind))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from megatron.training.arguments import parse_args;"
        "sys.argv = ['pretrain_gpt.py'] + sys.argv[2:];"
        "a = parse_args(); print('PARSED', a.num_layers, a.kv_channels, a.num_query_groups, a.spec)"
    )
    common = [
        "--micro-batch-size",
        "1",
        "--seq-length",
        "64",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "256",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", code, TRAINING, *flags, *common], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PARSED 4" in proc.stdout and "qwen_layer_spec" in proc.stdout


_HYBRID_PARSE = """
import argparse, sys
sys.path.insert(0, sys.argv[1])
from megatron.training.arguments import add_megatron_arguments
from twinkle_specs.launch import add_twinkle_args, architecture_conflicts, merge_flags
hf = sys.argv[2]
parser = add_twinkle_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
user = ["--hf-model", hf, "--micro-batch-size", "1", "--seq-length", "64", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256"]
args = parser.parse_args(merge_flags(hf, user))
print("PARSED", args.experimental_attention_variant, args.linear_attention_freq, args.num_experts)
print("CONFLICTS", architecture_conflicts(args, parser, hf))
print("INTERLEAVED", architecture_conflicts(parser.parse_args(merge_flags(hf, user) + ["--rotary-interleaved"]), parser, hf))
"""


@pytest.mark.skipif(
    not TRAINING,
    reason="needs megatron.training: megatron-core 0.19+ (its wheel ships it; the Python 3.12 CI leg) "
    "or a stock Megatron-LM checkout in $MEGATRON_LM_ROOT",
)
@pytest.mark.parametrize("kind,experts", [("qwen3_next", 4), ("qwen3_5", None), ("qwen3_5_moe", 4)])
def test_hybrid_launch_flags_parse_and_pass_the_architecture_check(kind, experts, tmp_path):
    """The launcher's flags for the hybrid models go through Megatron-LM's own parser (the Gated DeltaNet
    variant and its per-layer pattern), agree with the checkpoint after parsing, and a flag that changes
    the architecture is still named."""
    from hybrid_models import make_hybrid_checkpoint

    hf = make_hybrid_checkpoint(kind, tmp_path / kind)
    proc = subprocess.run(
        [sys.executable, "-c", _HYBRID_PARSE, TRAINING, str(hf)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"PARSED gated_delta_net [1, 0, 0, 1] {experts}" in proc.stdout, proc.stdout[-2000:]
    assert "CONFLICTS []" in proc.stdout
    assert "INTERLEAVED ['--rotary-interleaved gives rotary_interleaved=True" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(
    not ROOT, reason="needs a stock Megatron-LM checkout in $MEGATRON_LM_ROOT (its pretrain_gpt.py)"
)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_stock_pretrain_gpt_trains_with_the_spec(kind, checkpoints, tmp_path):
    flags = ts.megatron_args_from_hf(checkpoints(kind))
    cmd = [
        *torchrun(1),
        str(Path(ROOT) / "pretrain_gpt.py"),
        *flags,
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--seq-length",
        "128",
        "--train-iters",
        "5",
        "--eval-interval",
        "5",
        "--eval-iters",
        "1",
        "--lr",
        "1e-4",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "255",
        "--bf16",
        "--log-interval",
        "1",
        "--transformer-impl",
        "transformer_engine",
        "--no-gradient-accumulation-fusion",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400)
    log = proc.stdout + proc.stderr
    out = os.environ.get("TWINKLE_EVIDENCE_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"pretrain_gpt-{kind}.log").write_text(" ".join(cmd) + "\n\n" + log[-20000:])
    assert proc.returncode == 0, log[-4000:]
    assert "iteration        5/       5" in log
