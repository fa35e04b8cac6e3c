"""twinkle_specs.launch against a stand-in of Megatron-LM's training entry point (tests/standin)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from models import CONFIGS

from twinkle_specs.launch import LaunchError, merge_flags

STANDIN = Path(__file__).parent / "standin"
COMMON = [
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "255",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
]


def launch(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    cmd = [
        *torchrun(1),
        "-m",
        "twinkle_specs.launch",
        str(STANDIN / "standin_pretrain_gpt.py"),
        *args,
    ]
    env = dict(
        os.environ,
        PYTHONPATH=f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        **env_vars,
    )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def hf_loss(hf: Path, tokens: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


def test_flags_from_checkpoint_then_user_flags(checkpoints):
    flags = merge_flags(
        str(checkpoints("qwen3")), ["--bf16", "--seq-length", "64", "--tokenizer-type", "NullTokenizer"]
    )
    assert flags[-4:] == ["--seq-length", "64", "--tokenizer-type", "NullTokenizer"]
    assert "--spec" in flags and "--qk-layernorm" in flags


def test_conflicting_architecture_flag_is_an_error(checkpoints):
    with pytest.raises(
        LaunchError, match=r"--num-layers 2 contradicts the checkpoint .*needs --num-layers 4"
    ):
        merge_flags(str(checkpoints("qwen3")), ["--num-layers", "2", "--tokenizer-type", "NullTokenizer"])


def test_overridable_flags_win_and_precision_switches(checkpoints):
    flags = merge_flags(
        str(checkpoints("qwen3")), ["--fp16", "--hidden-dropout", "0.1", "--tokenizer-type", "X"]
    )
    assert flags.count("--hidden-dropout") == 1 and "--bf16" not in flags


def test_missing_tokenizer_is_explained(checkpoints):
    with pytest.raises(LaunchError, match="no tokenizer files"):
        merge_flags(str(checkpoints("qwen3")), [])


def test_save_without_interval_is_explained(checkpoints):
    with pytest.raises(LaunchError, match=r"--save /ck needs --save-interval N"):
        merge_flags(str(checkpoints("qwen3")), ["--save", "/ck", "--lr", "1e-4"])
    for interval in (["--save-interval", "5"], ["--persistent-save-interval=5"]):  # Megatron's alias
        assert "--save" in merge_flags(
            str(checkpoints("qwen3")), ["--save", "/ck", *interval, "--tokenizer-type", "X"]
        )


def test_other_spec_is_rejected(checkpoints):
    with pytest.raises(LaunchError, match="--spec"):
        merge_flags(str(checkpoints("qwen3")), ["--spec", "my", "spec", "--tokenizer-type", "X"])


def test_help_lists_twinkle_flags():
    proc = launch("--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--hf-model" in proc.stdout and "--lora-rank" in proc.stdout and "--num-layers" in proc.stdout


def test_full_finetune_loads_hf_weights_trains_and_exports(checkpoints, tmp_path):
    hf = checkpoints("qwen3")
    proc = launch(
        "--hf-model",
        str(hf),
        *COMMON,
        "--train-iters",
        "3",
        "--lr",
        "0.05",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "3",
        "--hf-export",
        str(tmp_path / "hf-out"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = torch.load(tmp_path / "ck" / "run.pt")
    losses = json.loads((tmp_path / "ck" / "losses.json").read_text())
    # Iteration 1 is the HF model's loss on the same batch: the weights were loaded, not initialised.
    assert abs(losses[0] - hf_loss(hf, run["tokens"])) <= 1e-4
    assert losses[-1] < losses[0]
    # The export is the trained model, loadable by transformers, giving the run's final logits.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-out", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = exported(run["tokens"][:, :-1]).logits
    assert (run["logits"][..., : CONFIGS["qwen3"]().vocab_size] - ref).abs().max().item() <= 1e-4


def test_lora_run_freezes_base_saves_adapters_only_and_exports_peft(checkpoints, tmp_path):
    hf = checkpoints("qwen3")
    proc = launch(
        "--hf-model",
        str(hf),
        *COMMON,
        "--train-iters",
        "3",
        "--lr",
        "0.5",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-target",
        "all-linear",
        "--hf-export",
        str(tmp_path / "adapter"),
        TWINKLE_DUMP_TRAINED=str(tmp_path / "trained"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = torch.load(tmp_path / "ck" / "run.pt")
    # the replica dump (compared across data-parallel ranks on the GPU machine): the trained adapters only
    trained = torch.load(tmp_path / "trained" / "rank0.pt")
    assert trained["coords"] == {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0, "etp": 0, "edp": 0}, trained[
        "coords"
    ]
    assert trained["params"] and all(".lora_" in k for k in trained["params"]), list(trained["params"])[:5]
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in exported.items() if ".lora_B." in k)  # B starts at zero
    losses = json.loads((tmp_path / "ck" / "losses.json").read_text())
    assert abs(losses[0] - hf_loss(hf, run["tokens"])) <= 1e-4  # B = 0 at start: exactly the base model
    assert losses[-1] < losses[0]
    keys = json.loads((tmp_path / "ck" / "iter_0000003" / "keys.json").read_text())
    assert keys and all(".lora_" in k for k in keys), keys[:5]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = peft_model(run["tokens"][:, :-1]).logits
    assert (run["logits"][..., : CONFIGS["qwen3"]().vocab_size] - ref).abs().max().item() <= 1e-4


def test_fractional_rope_theta_reaches_the_model_exactly(tmp_path):
    """Megatron-LM parses --rotary-base as an int (so does the stand-in): the launcher gives GPTModel
    the checkpoint's own rope_theta, and its RoPE frequencies are transformers' (not int(theta)'s)."""
    from models import make_checkpoint
    from transformers import AutoModelForCausalLM

    theta = 12345.5
    hf = make_checkpoint(
        "qwen3", tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": theta}
    )
    proc = launch(
        "--hf-model",
        str(hf),
        *COMMON,
        "--train-iters",
        "1",
        "--lr",
        "0",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "1",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ours = torch.load(tmp_path / "ck" / "run.pt")["inv_freq"].double()
    ref = AutoModelForCausalLM.from_pretrained(hf).model.rotary_emb.inv_freq.double()
    dim = 2 * ref.numel()
    truncated = 1.0 / int(theta) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert (ours - ref).abs().max() <= 1e-7 * ref.abs().max()
    assert (truncated - ref).abs().max() > 1e-6 * ref.abs().max()  # the check can tell the two apart


def _parsers():
    """Megatron's parser with the launcher's flags: the stand-in's, and stock Megatron-LM's where it is
    importable (PYTHONPATH=$MEGATRON_LM_ROOT; its megatron/training is not in the megatron-core wheel)."""
    import argparse
    import importlib.util
    import typing

    from twinkle_specs.launch import add_twinkle_args

    # By path, under its own name: the stand-in must not become this process's megatron.training.
    spec = importlib.util.spec_from_file_location(
        "standin_megatron_arguments", STANDIN / "megatron" / "training" / "arguments.py"
    )
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    parsers = {"standin": standin.add_megatron_arguments}
    if os.environ.get("MEGATRON_LM_ROOT") and importlib.util.find_spec("megatron.training"):
        if not hasattr(typing, "override"):  # Megatron-LM core_v0.19 imports it (Python 3.12)
            import typing_extensions

            typing.override = typing_extensions.override
        from megatron.training.arguments import add_megatron_arguments

        parsers["megatron-lm"] = add_megatron_arguments
    return {
        name: (lambda add=add: add_twinkle_args(add(argparse.ArgumentParser(allow_abbrev=False))))
        for name, add in parsers.items()
    }


# (checkpoint, user flag(s), flag named, checkpoint value, config.json field)
ARCH_CONFLICTS = [
    (
        "qwen2",
        ["--untie-embeddings-and-output-weights"],
        "--untie-embeddings-and-output-weights",
        "False",
        "tie_word_embeddings",
    ),
    ("qwen3", ["--rotary-interleaved"], "--rotary-interleaved", "False", "rope_parameters"),
    ("qwen3", ["--rotary-percent", "0.5"], "--rotary-percent", "1.0", "rope_parameters"),
    ("qwen3", ["--apply-layernorm-1p"], "--apply-layernorm-1p", "False", "architectures"),
    ("qwen3", ["--num-experts", "4"], "--num-experts", "None", "architectures"),
    ("qwen3", ["--add-qkv-bias"], "--add-qkv-bias", "False", "attention_bias"),
    ("qwen2", ["--qk-layernorm"], "--qk-layernorm", "False", "model_type"),
    (
        "qwen3_moe",
        ["--moe-router-score-function", "sigmoid"],
        "--moe-router-score-function",
        "'softmax'",
        "num_experts_per_tok",
    ),
    ("qwen3_moe", ["--moe-router-pre-softmax"], "--moe-router-pre-softmax", "False", "norm_topk_prob"),
]


@pytest.mark.parametrize("kind,user,flag,needed,field", ARCH_CONFLICTS)
@pytest.mark.parametrize("parser_name", ["standin", "megatron-lm"])
def test_parsed_flag_that_contradicts_the_checkpoint_is_named(
    parser_name, kind, user, flag, needed, field, checkpoints
):
    """Flags the checkpoint does not print (so merge_flags lets them through) are compared after
    Megatron's parser has run: one line naming the flag, the checkpoint's value and its field."""
    from twinkle_specs.launch import architecture_conflicts, check_architecture

    parsers = _parsers()
    if parser_name not in parsers:
        pytest.skip("needs a stock Megatron-LM checkout in $MEGATRON_LM_ROOT")
    parser = parsers[parser_name]()
    hf = checkpoints(kind)
    args = parser.parse_args(merge_flags(str(hf), [*COMMON, *user]))
    (conflict,) = architecture_conflicts(args, parser, hf)
    assert conflict.startswith(f"{flag} gives ") and "needs " in conflict, conflict
    assert conflict.split(" needs ")[1].split("=", 1)[1].startswith(f"{needed} (config.json field {field})")
    with pytest.raises(LaunchError, match=rf"^{flag} gives .*Drop these flags") as err:
        check_architecture(args, parser, hf)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("parser_name", ["standin", "megatron-lm"])
def test_checkpoint_flags_and_overrides_pass_the_architecture_check(parser_name, kind, checkpoints):
    from twinkle_specs.launch import architecture_conflicts

    parsers = _parsers()
    if parser_name not in parsers:
        pytest.skip("needs a stock Megatron-LM checkout in $MEGATRON_LM_ROOT")
    parser = parsers[parser_name]()
    hf = checkpoints(kind)
    user = [
        "--fp16",
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
        "--max-position-embeddings",
        "64",
    ]
    user += ["--make-vocab-size-divisible-by", "1", "--init-method-std", "0.01"]
    args = parser.parse_args(merge_flags(str(hf), [*COMMON, *user]))
    assert architecture_conflicts(args, parser, hf) == []


def test_launch_refuses_untied_output_layer_on_a_tied_checkpoint(checkpoints, tmp_path):
    """A tied Qwen2 with --untie-embeddings-and-output-weights would train an output layer that the
    HF export drops; the launcher stops after Megatron's parse, before building anything."""
    proc = launch(
        "--hf-model",
        str(checkpoints("qwen2")),
        *COMMON,
        "--train-iters",
        "1",
        "--lr",
        "0.05",
        "--untie-embeddings-and-output-weights",
        "--hf-export",
        str(tmp_path / "hf-out"),
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert (
        "twinkle_specs.launch: error: --untie-embeddings-and-output-weights gives "
        "untie_embeddings_and_output_weights=True but"
    ) in proc.stderr, proc.stderr[-3000:]
    assert "config.json field tie_word_embeddings" in proc.stderr
    assert not (tmp_path / "hf-out").exists()


@pytest.mark.parametrize(
    "kind,user",
    [
        ("qwen3", ["--norm-epsilon", "1e-6"]),  # the checkpoint's flag says 1e-06
        ("qwen3", ["--norm-epsilon=0.000001"]),
        ("qwen2_5", ["--rotary-base", "1000000.0"]),  # the checkpoint's flag says 1000000
        ("qwen2_5", ["--rotary-base", "1e6"]),
        ("qwen3_moe", ["--moe-aux-loss-coeff", "1e-3"]),
        ("qwen3", ["--num-layers", "4.0"]),
    ],
)
def test_equal_numbers_spelled_differently_are_no_conflict(kind, user, checkpoints):
    flags = merge_flags(str(checkpoints(kind)), [*user, "--tokenizer-type", "X"])
    assert flags[-len(user) - 2 :] == [*user, "--tokenizer-type", "X"]


@pytest.mark.parametrize(
    "kind,user,needed",
    [
        ("qwen3", ["--norm-epsilon", "1e-5"], "1e-06"),
        ("qwen2_5", ["--rotary-base", "1000000.5"], "1000000"),
        ("qwen3", ["--num-layers", "4.5"], "4"),
    ],
)
def test_different_numbers_are_still_a_conflict(kind, user, needed, checkpoints):
    with pytest.raises(LaunchError, match=rf"{user[0]} {user[1]} contradicts .*needs {user[0]} {needed};"):
        merge_flags(str(checkpoints(kind)), [*user, "--tokenizer-type", "X"])


def test_same_value_compares_numbers_as_numbers():
    """The one comparison that merge_flags (text) and architecture_conflicts (parsed args) share."""
    from twinkle_specs.launch import same_value

    assert same_value(["1e-6"], ["1e-06"]) and same_value("0.001", 1e-3) and same_value(1e-06, "1e-6")
    assert same_value(1000000, "1000000.0") and same_value([1, 0, 1], ["1", "0.0", "1"])
    assert not same_value("1e-5", 1e-6) and not same_value(["4"], ["4", "4"])
    assert not same_value(True, 1) and not same_value(False, "0") and same_value(None, None)
    assert same_value("rope", "rope") and not same_value("rope", "yarn") and not same_value(None, 0)


def test_batch_dump_starts_at_a_later_micro_batch(tmp_path, monkeypatch):
    """$TWINKLE_DUMP_BATCHES_FROM skips that many training micro-batches before dumping COUNT of them (the
    batches an export made at a later iteration is checked on); evaluation forwards are never dumped."""
    from megatron.core import parallel_state as ps

    from twinkle_specs import launch

    for rank in (
        "get_tensor_model_parallel_rank",
        "get_data_parallel_rank",
        "get_pipeline_model_parallel_rank",
    ):
        monkeypatch.setattr(ps, rank, lambda: 0)
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setenv("TWINKLE_DUMP_BATCHES", str(tmp_path))
    monkeypatch.setenv("TWINKLE_DUMP_BATCHES_FROM", "3")
    monkeypatch.setenv("TWINKLE_DUMP_BATCHES_COUNT", "2")

    class Stage(torch.nn.Module):
        pre_process = post_process = True

        def forward(self, input_ids, labels=None):
            return input_ids

    model = Stage()
    launch._maybe_dump_batches(model)
    model.eval()
    model(torch.full((1, 4), -1), labels=torch.full((1, 4), -1))  # not training: neither counted nor saved
    model.train()
    for i in range(7):
        model(torch.full((1, 4), i), labels=torch.full((1, 4), i + 100))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp0-mb3-pp0.pt", "dp0-mb4-pp0.pt"]
    for n in (3, 4):
        saved = torch.load(tmp_path / f"dp0-mb{n}-pp0.pt")
        assert saved["tokens"].unique().tolist() == [n] and saved["labels"].unique().tolist() == [n + 100]
    # context parallel: a rank holds parts of each sequence, and the group's ranks would share file names
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setenv("TWINKLE_DUMP_BATCHES", str(tmp_path / "cp2"))
    split = Stage()
    launch._maybe_dump_batches(split)
    for i in range(4):
        split(torch.full((1, 4), i), labels=torch.full((1, 4), i))
    assert not (tmp_path / "cp2").exists()


def test_lora_moe_run_exports_routed_experts_per_expert(checkpoints, tmp_path):
    """--hf-export-expert-layout per-expert: the routed experts under transformers 4's per-expert names (at
    rank r: Megatron's linear_fc1/linear_fc2 targets), which peft 0.21 reads back into the trained model."""
    hf = checkpoints("qwen3_moe")
    out = tmp_path / "adapter"
    proc = launch(
        "--hf-model",
        str(hf),
        *COMMON,
        "--train-iters",
        "2",
        "--lr",
        "0.5",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "2",
        "--lora-rank",
        "4",
        "--lora-target",
        "linear_qkv,linear_fc1,linear_fc2",
        "--hf-export",
        str(out),
        "--hf-export-expert-layout",
        "per-expert",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    from safetensors.torch import load_file

    keys = set(load_file(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_B.weight" in keys, sorted(keys)[:8]
    assert not any("experts.lora_" in k or "base_layer" in k for k in keys), sorted(keys)[:8]
    config = json.loads((out / "adapter_config.json").read_text())
    assert {"gate_proj", "up_proj", "down_proj", "q_proj"} <= set(config["target_modules"]), config
    run = torch.load(tmp_path / "ck" / "run.pt")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        plain = base(run["tokens"][:, :-1]).logits
        ref = PeftModel.from_pretrained(base, out).eval()(run["tokens"][:, :-1]).logits
    logits = run["logits"][..., : CONFIGS["qwen3_moe"]().vocab_size]
    assert (logits - plain).abs().max().item() > 1e-2  # the trained adapter changes the model
    assert (logits - ref).abs().max().item() <= 1e-4
