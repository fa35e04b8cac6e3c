"""``twinkle-specs convert`` / ``export``: HF -> Megatron-LM torch_dist -> HF (CPU, gloo).

Conversions run at TP2 x PP2 (Qwen3) and EP2 (Qwen3-MoE) in spawned ranks; everything is then loaded
in this process at TP1/PP1/EP1, a different layout, so the checkpoint is resharded on load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import megatron_training_root
from gpu_checks import HYBRID_FP32_MAX_ABS, fp32_max_abs, fp32_router
from hybrid_models import hybrid_batch, hybrid_hf_logits, make_hybrid_checkpoint
from models import batch, hf_logits, make_checkpoint
from safetensors.torch import load_file

import twinkle_specs as ts
from twinkle_specs.cli import main as cli
from twinkle_specs.megatron_checkpoint import (
    RELEASE,
    TRACKER,
    Layout,
    MegatronCheckpointError,
    convert,
    export,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen3_ckpt(checkpoints, tmp_path_factory):
    hf = checkpoints("qwen3")
    out = tmp_path_factory.mktemp("mcore") / "qwen3-tp2pp2"
    convert(hf, out, Layout(tp=2, pp=2))
    return hf, out


@pytest.fixture(scope="module")
def moe_ckpt(checkpoints, tmp_path_factory):
    hf = checkpoints("qwen3_moe")
    out = tmp_path_factory.mktemp("mcore") / "qwen3moe-ep2"
    convert(hf, out, Layout(ep=2))
    return hf, out


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    """Qwen3.5 as released (the multimodal checkpoint), its Gated DeltaNet and gated attention layers."""
    hf = make_hybrid_checkpoint("qwen3_5_vl", tmp_path_factory.mktemp("hf-hybrid") / "qwen3_5_vl")
    out = tmp_path_factory.mktemp("mcore") / "qwen3_5_vl"
    convert(hf, out, Layout())
    return hf, out


def _load_full(hf: Path, ckpt: Path) -> torch.nn.Module:
    """A TP1/PP1 model with no HF weights, filled from the Megatron checkpoint only."""
    from megatron.core import dist_checkpointing

    model = ts.build_model(hf, load_weights=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt / RELEASE))
    model.load_state_dict(loaded["model"], strict=True)
    return model


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, None)


def _max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours[..., : ref.shape[-1]] - ref).abs().max().item()


def _hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_convert_writes_what_megatron_lm_reads(qwen3_ckpt):
    from megatron.core import dist_checkpointing

    _, ckpt = qwen3_ckpt
    assert (ckpt / TRACKER).read_text() == RELEASE
    common = dist_checkpointing.load_common_state_dict(str(ckpt / RELEASE))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (4, 64, 4)
    assert args.ckpt_format == "torch_dist" and args.add_bias_linear is False


@pytest.mark.parametrize("which", ["qwen3_ckpt", "moe_ckpt"])
def test_converted_checkpoint_loads_at_another_layout(which, request, megatron_single):
    hf, ckpt = request.getfixturevalue(which)
    tokens = batch()
    diff = _max_diff(_logits(_load_full(hf, ckpt), tokens), hf_logits(hf, tokens))
    print(f"{which}: max |Δ logits| vs transformers {diff:.3e}")
    assert diff <= TOL, f"{which}: max |logits - transformers| = {diff:.3e} > {TOL}"


@pytest.mark.parametrize("which", ["qwen3_ckpt", "moe_ckpt"])
def test_convert_export_round_trip_is_bit_exact(which, request, tmp_path):
    hf, ckpt = request.getfixturevalue(which)
    assert export(ckpt, hf, tmp_path / "hf") == "full"
    ours, ref = _hf_tensors(tmp_path / "hf"), _hf_tensors(hf)
    assert sorted(ours) == sorted(ref)
    differ = [k for k in ref if ours[k].dtype != ref[k].dtype or not torch.equal(ours[k], ref[k])]
    assert not differ, f"tensors not bit-exact after convert -> export: {differ}"


def _lora_checkpoint(
    hf: Path, root: Path, saved_args: dict | None, targets: tuple[str, ...] = ("all-linear",)
) -> tuple[Path, torch.Tensor]:
    """An adapter-only checkpoint as the launcher saves one (``model`` = adapters_only, args with
    the --lora-* flags, iter_0000003 + tracker), with random factors; returns it and Megatron logits."""
    from megatron.core import dist_checkpointing

    from twinkle_specs.lora.checkpoint import adapters_only

    lora = ts.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    model = ts.build_model(hf, lora=lora).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ckpt = root / "lora-run"
    (ckpt / "iter_0000003").mkdir(parents=True)
    state = {"model": adapters_only(model.sharded_state_dict()), "checkpoint_version": 3.0, "iteration": 3}
    if saved_args is not None:
        state["args"] = argparse.Namespace(**saved_args)
    dist_checkpointing.save(state, str(ckpt / "iter_0000003"))
    (ckpt / TRACKER).write_text("3")
    return ckpt, _logits(model, batch())


LORA_ARGS = dict(lora_rank=4, lora_alpha=8.0, lora_target="all-linear", lora_dropout=0.0, lora_rslora=False)


def test_lora_checkpoint_exports_peft_and_merged(checkpoints, tmp_path, megatron_single):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = checkpoints("qwen3")
    ckpt, megatron = _lora_checkpoint(hf, tmp_path, LORA_ARGS)
    assert cli(["export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(tmp_path / "peft")]) == 0
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        ref = peft(batch()).logits
    diff = _max_diff(megatron, ref)
    print(f"LoRA PEFT export: max |Δ logits| {diff:.3e}")
    assert diff <= TOL, f"PEFT adapter from the LoRA checkpoint: max |Δ logits| = {diff:.3e} > {TOL}"

    assert export(ckpt, hf, tmp_path / "merged", mode="merged") == "merged"
    diff = _max_diff(megatron, hf_logits(tmp_path / "merged", batch()))
    print(f"LoRA merged export: max |Δ logits| {diff:.3e}")
    assert diff <= TOL, f"merged export of the LoRA checkpoint: max |Δ logits| = {diff:.3e} > {TOL}"


def test_moe_lora_checkpoint_exports_experts_per_expert(checkpoints, tmp_path, megatron_single):
    """``twinkle-specs export --expert-layout per-expert``: Qwen3-MoE's routed experts under transformers 4's
    per-expert names, which peft 0.21 reads back into the checkpoint's model."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = checkpoints("qwen3_moe")
    targets = ("linear_qkv", "linear_fc1", "linear_fc2")
    ckpt, megatron = _lora_checkpoint(hf, tmp_path, LORA_ARGS | {"lora_target": ",".join(targets)}, targets)
    out = tmp_path / "peft"
    args = [
        "export",
        "--load",
        str(ckpt),
        "--hf-model",
        str(hf),
        "--out",
        str(out),
        "--expert-layout",
        "per-expert",
    ]
    assert cli(args) == 0
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_A.weight" in keys, sorted(keys)[:8]
    assert not any("experts.lora_" in k for k in keys), sorted(keys)[:8]
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        ref = PeftModel.from_pretrained(base, out).eval()(batch()).logits
    diff = _max_diff(megatron, ref)
    print(f"MoE LoRA per-expert export: max |Δ logits| {diff:.3e}")
    assert diff <= TOL, (
        f"per-expert PEFT adapter from the LoRA checkpoint: max |Δ logits| = {diff:.3e} > {TOL}"
    )
    with pytest.raises(MegatronCheckpointError, match="--expert-layout per-expert lays out a PEFT adapter's"):
        export(ckpt, hf, tmp_path / "merged", mode="merged", expert_layout="per-expert")


def test_lora_checkpoint_without_saved_flags_names_the_flag(checkpoints, tmp_path, megatron_single):
    hf = checkpoints("qwen3")
    ckpt, megatron = _lora_checkpoint(hf, tmp_path, None)
    with pytest.raises(MegatronCheckpointError, match="--lora-rank"):
        export(ckpt, hf, tmp_path / "peft")
    assert export(ckpt, hf, tmp_path / "peft", lora_overrides={"lora_rank": 4, "lora_alpha": 8}) == "peft"


# ------------------------------------------------------------------------------------------- errors


def test_convert_rejects_bad_layout_and_non_empty_save(checkpoints, tmp_path):
    hf = checkpoints("qwen3")
    with pytest.raises(MegatronCheckpointError, match=r"--tp 3 does not divide num_attention_heads=4"):
        convert(hf, tmp_path / "a", Layout(tp=3))
    with pytest.raises(MegatronCheckpointError, match=r"--pp 3 does not divide num_hidden_layers=4"):
        convert(hf, tmp_path / "a", Layout(pp=3))
    with pytest.raises(MegatronCheckpointError, match="--ep/--etp need a mixture-of-experts"):
        convert(hf, tmp_path / "a", Layout(ep=2))
    assert cli(["convert", "--hf-model", str(hf), "--save", str(tmp_path / "a"), "--tp", "3"]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(MegatronCheckpointError, match="not empty.*--force"):
        convert(hf, tmp_path / "full", Layout())
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_export_errors_name_the_problem(qwen3_ckpt, checkpoints, tmp_path, megatron_single):
    hf, ckpt = qwen3_ckpt
    with pytest.raises(MegatronCheckpointError, match="no such directory"):
        export(tmp_path / "nope", hf, tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MegatronCheckpointError, match=TRACKER):
        export(tmp_path / "empty", hf, tmp_path / "o")
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (legacy / TRACKER).write_text("2")
    with pytest.raises(
        MegatronCheckpointError, match="not a torch_dist checkpoint.*--ckpt-format torch_dist"
    ):
        export(legacy, hf, tmp_path / "o")
    with pytest.raises(MegatronCheckpointError, match="iter_0000007/ does not exist"):
        export(ckpt, hf, tmp_path / "o", iteration=7)
    # Another model: tensors it needs are absent / a tensor has another shape (FFN 96 vs 128).
    with pytest.raises(
        MegatronCheckpointError, match=r"'decoder.layers.mlp.router.weight'.* not in the checkpoint"
    ):
        export(ckpt, checkpoints("qwen3_moe"), tmp_path / "o")
    wider = make_checkpoint("qwen3", tmp_path / "wider", intermediate_size=128)
    with pytest.raises(
        MegatronCheckpointError, match=r"'decoder.layers.mlp.linear_fc1.weight' has shape \[4, 192, 64\]"
    ):
        export(ckpt, wider, tmp_path / "o")
    with pytest.raises(MegatronCheckpointError, match="no LoRA factors"):
        export(ckpt, hf, tmp_path / "o", mode="peft")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("keep")
    with pytest.raises(MegatronCheckpointError, match="--out .* not empty"):
        export(ckpt, hf, tmp_path / "used")
    assert cli(["export", "--load", str(tmp_path / "nope"), "--hf-model", str(hf), "--out", "o"]) == 2


# --------------------------------------------------------------------------- real Megatron-LM loading

ROOT = megatron_training_root()


@pytest.mark.skipif(
    not ROOT,
    reason="needs megatron.training: megatron-core 0.19+ (the Python 3.12 CI leg) or a stock Megatron-LM "
    "checkout in $MEGATRON_LM_ROOT",
)
@pytest.mark.parametrize("finetune", [True, False])
def test_megatron_lm_load_checkpoint_reads_the_conversion(qwen3_ckpt, finetune):
    """Megatron-LM's own load_checkpoint (not ours) on the TP2xPP2 conversion, at TP1/PP1."""
    hf, ckpt = qwen3_ckpt
    script = Path(__file__).with_name("megatron_lm_load.py")
    cmd = [sys.executable, str(script), "--hf-model", str(hf), "--load", str(ckpt)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for var in ("MASTER_ADDR", "MASTER_PORT"):  # this process's own rendezvous (megatron_single)
        env.pop(var, None)
    if not torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        cmd + (["--finetune"] if finetune else []), capture_output=True, text=True, env=env, timeout=300
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "LOADED OK" in log, log[-4000:]
    assert "loading release distributed checkpoint" in log


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine")
@pytest.mark.parametrize("which", ["qwen3_ckpt", "moe_ckpt", "hybrid_ckpt"])
def test_transformer_engine_model_finds_every_key_it_loads(which, request, megatron_single):
    """The conversion is written by portable CPU modules; a Transformer Engine model (what pretrain_gpt
    builds on a GPU) must find every key it asks for, TE's ``_extra_state`` included, and match HF (the
    hybrid: a Gated DeltaNet layer's input norm is fused into in_proj there)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from twinkle_specs.parity import compare_logits

    hf, ckpt = request.getfixturevalue(which)
    model = ts.build_model(
        hf, load_weights=False, parallel_output=False, **fp32_router(which, torch.float32)
    ).eval()
    assert model.config.transformer_impl == "transformer_engine"
    loaded, _, absent = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(ckpt / RELEASE), strict=StrictHandling.RETURN_ALL
    )
    # megatron-core calls these "unexpected": asked for by the model, absent from the checkpoint.
    assert not absent, (
        f"{len(absent)} keys the TE model loads are not in the conversion: {sorted(absent)[:8]}"
    )
    model.load_state_dict(loaded["model"], strict=True)
    hybrid = which == "hybrid_ckpt"
    tokens = hybrid_batch() if hybrid else batch(s=64)
    pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    with torch.no_grad():
        ours = model(tokens.cuda(), pos, None)
    ref = hybrid_hf_logits(hf, tokens, device="cuda") if hybrid else hf_logits(hf, tokens)
    report = compare_logits(ours, ref)
    print(f"{which}: TE model from the conversion vs transformers (fp32): {report}")
    bound = HYBRID_FP32_MAX_ABS if hybrid else fp32_max_abs(which)
    assert report.max_abs <= bound, report
