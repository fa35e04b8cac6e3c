"""Strict loading: each bad checkpoint gives an error that names the file/tensor; sharded checkpoints load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import cpu_reference
from models import CONFIGS, SAFE, batch, hf_logits, make_checkpoint, rewrite_checkpoint
from safetensors.torch import load_file

import twinkle_specs as ts
from twinkle_specs.checkpoint import CheckpointError

pytestmark = cpu_reference


def _build(hf: Path):
    return ts.build_model(hf)


def test_missing_tensor(checkpoints, tmp_path, megatron_single):
    bad = rewrite_checkpoint(
        checkpoints("qwen3"), tmp_path / "bad", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")
    )
    with pytest.raises(
        CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.self_attn.k_norm.weight'\]"
    ):
        _build(bad)


def test_unused_tensor(checkpoints, tmp_path, megatron_single):
    bad = rewrite_checkpoint(
        checkpoints("qwen3"), tmp_path / "bad", lambda t: t.update({"model.extra.weight": torch.ones(2)})
    )
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        _build(bad)


def test_wrong_shape(checkpoints, tmp_path, megatron_single):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    bad = rewrite_checkpoint(checkpoints("qwen3"), tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight' has shape \[95, 64\]"):
        _build(bad)


def test_truncated_file(checkpoints, tmp_path, megatron_single):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints("qwen3"), bad)
    data = (bad / SAFE).read_bytes()
    (bad / SAFE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors.*truncated"):
        _build(bad)


def test_no_weights(checkpoints, tmp_path, megatron_single):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints("qwen3"), bad)
    (bad / SAFE).unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
        _build(bad)


def test_sharded_checkpoint_with_index_loads(tmp_path, megatron_single):
    hf = make_checkpoint("qwen3_moe", tmp_path / "sharded", max_shard_size="100KB")
    assert len(list(hf.glob("*.safetensors"))) > 1 and (hf / "model.safetensors.index.json").exists()
    model = ts.build_model(hf).eval()
    tokens = batch()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    ref = hf_logits(hf, tokens)
    assert (ours[..., : CONFIGS["qwen3_moe"]().vocab_size] - ref).abs().max().item() <= 1e-4


def test_bf16_checkpoint_into_fp32_model_converts_explicitly_and_exports_bit_exact(
    checkpoints, tmp_path, megatron_single
):
    src = checkpoints("qwen3")
    bf16 = tmp_path / "bf16"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(bf16)
    model = ts.build_model(bf16, load_weights=False, params_dtype=torch.float32)
    report = ts.load_hf_weights(model, bf16)
    assert report.conversions["bfloat16->float32"] == report.parameters
    ts.save_hf_weights(model, tmp_path / "out")  # default dtype: the source's (bfloat16)
    a, b = load_file(bf16 / SAFE), {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        b |= load_file(f)
    assert all(torch.equal(a[k], b[k]) and b[k].dtype == torch.bfloat16 for k in a)


def test_export_loads_in_transformers(checkpoints, tmp_path, megatron_single):
    from transformers import AutoModelForCausalLM

    model = ts.build_model(checkpoints("qwen2_moe"))
    ts.save_hf_weights(model, tmp_path / "out", max_shard_bytes=200_000)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokens = batch()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_logits(checkpoints("qwen2_moe"), tokens))
