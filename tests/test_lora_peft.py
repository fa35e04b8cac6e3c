"""HF+PEFT logits == Megatron+LoRA logits (fp32, CPU, portable path, TP=1), both exchange directions,
and the errors for bad targets and mismatched adapters."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from conftest import cpu_reference
from test_lora_support import (
    EXPERT_PROJS,
    hf_model,
    megatron_logits,
    randomize_megatron,
    randomize_peft,
    single_rank,  # noqa: F401  (fixture)
    tokens,
    transformers4_adapter,
)

import twinkle_specs as ts
from twinkle_specs import LoraConfig, export_peft_adapter, load_peft_adapter

pytestmark = cpu_reference


TOL = 1e-4  # max |Δ| of fp32 logits; measured on torch 2.13 CPU: 0.0 dense, <= 2.6e-6 MoE
BOTH_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CASES = {
    "qwen3-all-linear": ("qwen3", dict(target_modules="all-linear")),
    "qwen3-q-v": ("qwen3", dict(target_modules=["q_proj", "v_proj"])),  # partial QKV: k rows untouched
    "qwen3-k-up-o-rslora": ("qwen3", dict(target_modules=["k_proj", "up_proj", "o_proj"], use_rslora=True)),
    "qwen2-bias-tied": (
        "qwen2",
        dict(target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"]),
    ),
    # MoE: attention + shared expert (HF gate/up/down match the shared expert's linears, as in PEFT)
    "qwen2_moe-attn-shared": (
        "qwen2_moe",
        dict(target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"]),
    ),
    # routed experts through peft's target_parameters (fused 3-D expert tensors), both and one
    "qwen3_moe-experts": ("qwen3_moe", dict(target_modules=["k_proj"], target_parameters=BOTH_EXPERTS)),
    "qwen3_moe-down": (
        "qwen3_moe",
        dict(target_modules=["v_proj"], target_parameters=["mlp.experts.down_proj"]),
    ),
    # v4 MLP names on Qwen3-MoE: peft maps them to the experts (gate_up_proj at rank 2r, alpha 2*alpha)
    "qwen3_moe-v4-names-rslora": (
        "qwen3_moe",
        dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], use_rslora=True),
    ),
    "qwen3_moe-all-linear": ("qwen3_moe", dict(target_modules="all-linear")),  # router (mlp.gate.weight) too
}
PARAMS = pytest.mark.parametrize("kind,targets", list(CASES.values()), ids=list(CASES))


@PARAMS
def test_peft_adapter_into_megatron(kind, targets, lora_checkpoints, tmp_path, single_rank):  # noqa: F811
    hf = lora_checkpoints(kind)
    ref_model = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, **targets))
    randomize_peft(ref_model)
    ref_model.save_pretrained(tmp_path)
    toks = tokens()
    with torch.no_grad():
        ref = ref_model(toks).logits
    model = ts.build_model(hf, lora=LoraConfig.from_peft(tmp_path), parallel_output=False).eval()
    before = megatron_logits(model, toks)
    load_peft_adapter(model, tmp_path)
    ours = megatron_logits(model, toks)
    assert (ref - before).abs().max() > 1e-2, "the adapter does not change the logits: test is vacuous"
    assert (ours - ref).abs().max().item() <= TOL


@PARAMS
def test_megatron_adapter_into_peft(kind, targets, lora_checkpoints, tmp_path, single_rank):  # noqa: F811
    hf = lora_checkpoints(kind)
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, **targets), parallel_output=False).eval()
    base = megatron_logits(model, tokens())
    randomize_megatron(model)
    ours = megatron_logits(model, tokens())
    export_peft_adapter(model, tmp_path, base_model_name_or_path="tiny/base")
    ref_model = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path).eval()
    assert ref_model.peft_config["default"].base_model_name_or_path == "tiny/base"
    with torch.no_grad():
        ref = ref_model(tokens()).logits
    assert (ours - base).abs().max() > 1e-2
    assert (ours - ref).abs().max().item() <= TOL


def test_adapter_config_is_the_same_file_in_every_process(tmp_path):
    """peft writes the fields it keeps as sets (target_modules) in hash order, which changes with each
    process's PYTHONHASHSEED; the export sorts them, so one adapter always gives one adapter_config.json
    (an FP8 run's export compares equal to a bf16 run's on the GPU), and peft reads it back the same."""
    from twinkle_specs.lora.peft_io import write_peft_config

    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, target_modules=names, target_parameters=["mlp.experts.down_proj"])
    write_peft_config(config, tmp_path)
    fields = json.loads((tmp_path / "adapter_config.json").read_text())
    assert fields["target_modules"] == sorted(names), fields["target_modules"]
    assert peft.LoraConfig.from_pretrained(str(tmp_path)).target_modules == set(names)


def test_unknown_target_names_the_target():
    with pytest.raises(ValueError, match="unknown target module 'qkv_proj'.*q_proj"):
        LoraConfig(target_modules=["qkv_proj"])
    with pytest.raises(ValueError, match="unknown target parameter 'mlp.experts.w1'"):
        LoraConfig(target_parameters=["mlp.experts.w1"])


def test_mismatched_adapters_are_refused(lora_checkpoints, tmp_path, single_rank):  # noqa: F811
    hf = lora_checkpoints("qwen3")
    ref_model = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    ref_model.save_pretrained(tmp_path / "r4")
    model = ts.build_model(hf, lora=LoraConfig(r=8, target_modules=["q_proj"]))
    with pytest.raises(
        ValueError, match=r"linear_qkv.q_proj: adapter r=4 alpha=8, model r=8 alpha=8.*LoraConfig.from_peft"
    ):
        load_peft_adapter(model, tmp_path / "r4")
    # An adapter made for another base (qwen2: other head layout, one layer more) is refused by name.
    other = lora_checkpoints("qwen2")
    other_model = peft.get_peft_model(hf_model(other), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    other_model.save_pretrained(tmp_path / "other")
    model = ts.build_model(hf, lora=LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="q_proj.lora_B.weight.*different base model"):
        load_peft_adapter(model, tmp_path / "other")
    # Qwen2-MoE's all-linear in peft includes shared_expert_gate, which Megatron's fused gate cannot host.
    moe = lora_checkpoints("qwen2_moe")
    gate_model = peft.get_peft_model(hf_model(moe), peft.LoraConfig(r=4, target_modules="all-linear"))
    gate_model.save_pretrained(tmp_path / "gate")
    with pytest.raises(ValueError, match="unknown target module 'shared_expert_gate'"):
        LoraConfig.from_peft(tmp_path / "gate")


def test_patterns_naming_every_layer_match_peft(lora_checkpoints, tmp_path, single_rank):  # noqa: F811
    """rank/alpha patterns are matched as peft matches them (against the module's full name), so keys
    that name layers but select the module in each of them mean what they mean in PeftModel."""
    hf = lora_checkpoints("qwen3")
    patterns = dict(
        rank_pattern={r"model\.layers\.\d+\.self_attn\.q_proj": 2},
        alpha_pattern={r"layers\.\d+\.mlp\.down_proj": 3, "o_proj": 16},
    )
    ref_model = peft.get_peft_model(
        hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **patterns)
    )
    randomize_peft(ref_model)
    ref_model.save_pretrained(tmp_path)
    toks = tokens()
    with torch.no_grad():
        ref = ref_model(toks).logits
    lora = LoraConfig.from_peft(tmp_path)
    model = ts.build_model(hf, lora=lora, parallel_output=False).eval()
    sites = ts.lora.peft_io.model_sites(model)
    assert sites["linear_qkv"]["q_proj"].r == 2 and sites["linear_fc2"]["down_proj"].lora_alpha == 3
    assert sites["linear_proj"]["o_proj"].lora_alpha == 16 and sites["linear_qkv"]["k_proj"].r == 4
    before = megatron_logits(model, toks)
    load_peft_adapter(model, tmp_path)
    ours = megatron_logits(model, toks)
    assert (ref - before).abs().max() > 1e-2, "the adapter does not change the logits: test is vacuous"
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "patterns",
    [
        dict(rank_pattern={r"0\.self_attn\.q_proj": 2}),
        dict(alpha_pattern={"model.layers.1.mlp.down_proj": 32}),
    ],
)
def test_patterns_selecting_some_layers_are_refused(
    patterns,
    lora_checkpoints,
    tmp_path,
    single_rank,  # noqa: F811
):
    """peft gives only the selected layers the pattern's rank/alpha; Megatron builds every layer from
    one spec, so such an adapter is refused by name (building the model, and loading into a model built
    otherwise) instead of applying the pattern to every layer."""
    import re

    hf = lora_checkpoints("qwen3")
    ref_model = peft.get_peft_model(
        hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **patterns)
    )
    layers = ref_model.base_model.model.model.layers
    per_layer = {(m.self_attn.q_proj.r["default"], m.mlp.down_proj.lora_alpha["default"]) for m in layers}
    assert len(per_layer) == 2, per_layer  # peft really adapts the layers differently
    ref_model.save_pretrained(tmp_path)
    (key,) = next(iter(patterns.values()))
    message = rf"pattern\(s\) \[{re.escape(repr(key))}\] give .* different adapters per layer"
    with pytest.raises(ValueError, match=message):
        ts.build_model(hf, lora=LoraConfig.from_peft(tmp_path))
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(model, tmp_path)


@pytest.mark.parametrize("projs", [EXPERT_PROJS, ("gate_proj", "up_proj"), ("down_proj",)], ids="-".join)
def test_transformers4_per_expert_adapter_into_megatron(projs, lora_checkpoints, tmp_path, single_rank):  # noqa: F811
    """An adapter trained when Qwen3-MoE's experts were separate linears loads as peft 0.21 loads it on
    transformers 5 (gate and up fused into one adapter of rank 2r, alpha 2*alpha). peft itself misnames gate
    and up converted without down (it nests them as if down were there, warns of missing keys and applies
    nothing), so that case's reference is the adapter with down as well, down's B zero."""
    hf = lora_checkpoints("qwen3_moe")
    adapter = transformers4_adapter(hf, tmp_path / "adapter", projs)
    reference = adapter
    if "gate_proj" in projs and "down_proj" not in projs:
        zero_down = lambda t: t.update({k: v * 0 for k, v in t.items() if "down_proj.lora_B" in k})  # noqa: E731
        reference = transformers4_adapter(hf, tmp_path / "reference", EXPERT_PROJS, edit=zero_down)
    inert = transformers4_adapter(hf, tmp_path / "inert", EXPERT_PROJS, expert_b_scale=0.0)
    toks = tokens()
    with torch.no_grad():
        ref = peft.PeftModel.from_pretrained(hf_model(hf), reference).eval()(toks).logits
        ref_inert = peft.PeftModel.from_pretrained(hf_model(hf), inert).eval()(toks).logits
    # peft applied the experts' factors (else the reference could not tell a dropped expert adapter)
    assert (ref - ref_inert).abs().max() > 1e-2
    model = ts.build_model(hf, lora=LoraConfig.from_peft(adapter), parallel_output=False).eval()
    load_peft_adapter(model, adapter)
    ours = megatron_logits(model, toks)
    assert (ours - ref).abs().max().item() <= TOL


def _drop(fragment: str):
    """An ``edit`` removing the tensors whose names hold ``fragment``."""

    def edit(tensors: dict) -> None:
        for key in [k for k in tensors if fragment in k]:
            del tensors[key]

    return edit


@pytest.mark.parametrize(
    "edit,match",
    [
        (_drop(".up_proj."), r"mlp\.experts has gate_proj adapters but no up_proj"),
        (_drop(".experts.3."), r"per-expert adapters are incomplete \(expert 3\)"),
        (_drop(".experts.1.down_proj.lora_B"), r"incomplete \(down_proj expert 1 lora_B\)"),
        (
            lambda t: t.update(
                {
                    k.replace(".experts.0.", ".experts.9."): v.clone()
                    for k, v in t.items()
                    if ".experts.0." in k
                }
            ),
            r"adapters for experts \[9\], the base model 4 experts",
        ),
        (
            lambda t: t.update({k: v[:2] for k, v in t.items() if ".experts.2.up_proj.lora_A" in k}),
            r"per-expert adapters do not fit together",
        ),
    ],
    ids=["gate-without-up", "missing-expert", "missing-factor", "extra-expert", "unequal-ranks"],
)
def test_transformers4_per_expert_adapter_errors_name_the_problem(
    edit,
    match,
    lora_checkpoints,
    tmp_path,
    single_rank,  # noqa: F811
):
    hf = lora_checkpoints("qwen3_moe")
    adapter = transformers4_adapter(hf, tmp_path / "adapter", EXPERT_PROJS, edit=edit)
    targets = ["q_proj", *EXPERT_PROJS]
    model = ts.build_model(
        hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules=targets), parallel_output=False
    )
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(model, adapter)


PER_EXPERT_CASES = {
    "both": dict(target_modules=["k_proj"], target_parameters=BOTH_EXPERTS),
    "gate-up": dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
    "down-router": dict(target_parameters=["mlp.experts.down_proj", "mlp.gate.weight"]),
}


@pytest.mark.parametrize("targets", list(PER_EXPERT_CASES.values()), ids=list(PER_EXPERT_CASES))
def test_per_expert_export_is_the_same_adapter(targets, lora_checkpoints, tmp_path, single_rank):  # noqa: F811
    """Routed experts exported per expert (transformers 4's names, what vLLM reads without options for
    Qwen3-MoE) are the fused export's adapter exactly: peft 0.21 converts them back on transformers 5 (gate and
    up at rank 2r, alpha 2 alpha) and gives the model's logits, as it does from the fused export, and twinkle
    loads them back the same. peft 0.21 misloads gate and up converted without down (see
    test_transformers4_per_expert_adapter_into_megatron), so there only twinkle's load is compared."""
    hf = lora_checkpoints("qwen3_moe")
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, **targets), parallel_output=False).eval()
    toks = tokens()
    base = megatron_logits(model, toks)
    randomize_megatron(model)
    ours = megatron_logits(model, toks)
    export_peft_adapter(model, tmp_path / "fused")
    export_peft_adapter(model, tmp_path / "per-expert", expert_layout="per-expert")

    from safetensors import safe_open

    with safe_open(tmp_path / "per-expert" / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    projs = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    slots = [p for param in targets.get("target_parameters", []) for p in projs.get(param.split(".")[-1], ())]
    expected = {
        f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}.lora_{w}.weight"
        for layer in range(2)
        for e in range(4)
        for proj in slots
        for w in "AB"
    }
    assert expected <= keys and not any("experts.lora_" in k or "base_layer" in k for k in keys), sorted(keys)
    config = json.loads((tmp_path / "per-expert" / "adapter_config.json").read_text())
    assert set(slots) <= set(config["target_modules"]), config
    assert not any("experts" in p for p in config.get("target_parameters") or []), config

    with torch.no_grad():
        fused = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "fused").eval()(toks).logits
        per_expert = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "per-expert").eval()(toks).logits
    assert (ours - base).abs().max() > 1e-2
    print(f"per-expert export max|Δ|: fused in peft {(ours - fused).abs().max():.3g}", end="")
    print(f", per-expert in peft {(ours - per_expert).abs().max():.3g}")
    assert (ours - fused).abs().max().item() <= TOL
    if "gate_proj" not in slots or "down_proj" in slots:  # peft 0.21 misloads gate + up without down
        assert (ours - per_expert).abs().max().item() <= TOL
    back = ts.build_model(
        hf, lora=LoraConfig.from_peft(tmp_path / "per-expert"), parallel_output=False
    ).eval()
    load_peft_adapter(back, tmp_path / "per-expert")
    assert (megatron_logits(back, toks) - ours).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "kind,lora,match",
    [
        ("qwen2_moe", dict(target_parameters=BOTH_EXPERTS), "no transformers 4 per-expert names"),
        (
            "qwen3_moe",
            dict(target_parameters=BOTH_EXPERTS, use_rslora=True),
            "changes an rsLoRA adapter's scale",
        ),
        (
            "qwen3_moe",
            dict(target_parameters=BOTH_EXPERTS, rank_pattern={r".*\.down_proj": 2}),
            r"config.s r=4 and alpha=8 \(experts.linear_fc2.down_proj r=2 alpha=8; HF MLP names",
        ),
    ],
    ids=["qwen2_moe", "rslora", "expert-rank"],
)
def test_per_expert_export_refuses_what_its_names_cannot_say(
    kind,
    lora,
    match,
    lora_checkpoints,
    tmp_path,
    single_rank,  # noqa: F811
):
    model = ts.build_model(lora_checkpoints(kind), lora=LoraConfig(r=4, lora_alpha=8, **lora))
    with pytest.raises(ValueError, match=f"expert_layout 'per-expert': .*{match}.*expert_layout 'fused'"):
        export_peft_adapter(model, tmp_path / "out", expert_layout="per-expert")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="expert_layout 'stacked': expected one of fused, per-expert"):
        export_peft_adapter(model, tmp_path / "out", expert_layout="stacked")


def test_expert_layout_flags_offer_what_the_export_takes():
    """The launcher's and the CLI's flag write the layouts out (parsing imports no torch): the same ones."""
    import argparse

    from twinkle_specs.cli import add_expert_layout_flag
    from twinkle_specs.lora.config import EXPERT_LAYOUTS

    parser = argparse.ArgumentParser()
    add_expert_layout_flag(parser, "--layout")
    assert tuple(parser._option_string_actions["--layout"].choices) == EXPERT_LAYOUTS
