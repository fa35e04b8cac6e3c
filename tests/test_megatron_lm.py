"""Against stock Megatron-LM: our flags parse with its own parser (megatron.training, from megatron-core
0.19's wheel or a checkout), and pretrain_gpt.py trains with ``--spec twinkle_specs qwen_layer_spec``
(needs a checkout in $MEGATRON_LM_ROOT, never vendored here, and a GPU)."""

from __future__ import annotations

import json
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


NEEDS_TRAINING = pytest.mark.skipif(
    not TRAINING,
    reason="needs megatron.training: megatron-core 0.19+ (its wheel ships it; the Python 3.12 CI leg) "
    "or a stock Megatron-LM checkout in $MEGATRON_LM_ROOT",
)
KINDS = ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"]
HYBRID = [("qwen3_next", 4), ("qwen3_5", None), ("qwen3_5_moe", 4)]

# Each parse below runs in a child process (megatron.training stays out of pytest's process); one child
# parses every case of a test, each case on its own (its exception is its own output), so the child's
# imports are paid once per test function rather than once per case.
_CASES = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
def run_cases(parse):
    for case in json.loads(sys.argv[2]):
        print(f"=== {case['name']}", flush=True)
        try:
            parse(*case["argv"])
        except BaseException:
            traceback.print_exc(file=sys.stdout)
        print(f"=== end {case['name']}", flush=True)
"""


def _run_cases(body: str, cases: dict[str, list[str]]) -> dict[str, str]:
    """Runs ``body`` (which calls ``run_cases(parse)``) in one child; each case's output, by name."""
    payload = json.dumps([{"name": n, "argv": argv} for n, argv in cases.items()])
    proc = subprocess.run(
        [sys.executable, "-c", _CASES + body, TRAINING, payload], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {n: proc.stdout.partition(f"=== {n}\n")[2].partition(f"=== end {n}\n")[0] for n in cases}


_PARSE = """
from megatron.training.arguments import parse_args
def parse(*argv):
    sys.argv = ["pretrain_gpt.py", *argv]
    a = parse_args(); print("PARSED", a.num_layers, a.kv_channels, a.num_query_groups, a.spec)
run_cases(parse)
"""


@pytest.fixture(scope="module")
def parsed(checkpoints):
    """Megatron-LM's ``parse_args`` output for each kind's flags (one child for all kinds)."""
    common = ["--micro-batch-size", "1", "--seq-length", "64", "--tokenizer-type", "NullTokenizer"]
    common += ["--vocab-size", "256"]
    cases = {kind: [*ts.megatron_args_from_hf(checkpoints(kind)), *common] for kind in KINDS}
    return _run_cases(_PARSE, cases)


@NEEDS_TRAINING
@pytest.mark.parametrize("kind", KINDS)
def test_flags_parse_with_megatron_lm_parser(kind, parsed):
    out = parsed[kind]
    assert "PARSED 4" in out and "qwen_layer_spec" in out, out[-3000:]


_HYBRID_PARSE = """
import argparse
from megatron.training.arguments import add_megatron_arguments
from twinkle_specs.launch import add_twinkle_args, architecture_conflicts, merge_flags
def parse(hf):
    parser = add_twinkle_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    user = ["--hf-model", hf, "--micro-batch-size", "1", "--seq-length", "64", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "256"]
    args = parser.parse_args(merge_flags(hf, user))
    print("PARSED", args.experimental_attention_variant, args.linear_attention_freq, args.num_experts)
    print("CONFLICTS", architecture_conflicts(args, parser, hf))
    print("INTERLEAVED", architecture_conflicts(parser.parse_args(merge_flags(hf, user) + ["--rotary-interleaved"]), parser, hf))
run_cases(parse)
"""


@pytest.fixture(scope="module")
def hybrid_parsed(tmp_path_factory):
    """The hybrid launch flags through Megatron-LM's parser for each kind (one child for all kinds)."""
    from hybrid_models import make_hybrid_checkpoint

    root = tmp_path_factory.mktemp("hybrid-parse")
    return _run_cases(
        _HYBRID_PARSE, {kind: [str(make_hybrid_checkpoint(kind, root / kind))] for kind, _ in HYBRID}
    )


@NEEDS_TRAINING
@pytest.mark.parametrize("kind,experts", HYBRID)
def test_hybrid_launch_flags_parse_and_pass_the_architecture_check(kind, experts, hybrid_parsed):
    """The launcher's flags for the hybrid models go through Megatron-LM's own parser (the Gated DeltaNet
    variant and its per-layer pattern), agree with the checkpoint after parsing, and a flag that changes
    the architecture is still named."""
    out = hybrid_parsed[kind]
    assert f"PARSED gated_delta_net [1, 0, 0, 1] {experts}" in out, out[-2000:]
    assert "CONFLICTS []" in out
    assert "INTERLEAVED ['--rotary-interleaved gives rotary_interleaved=True" in out


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
