"""LoRA on the hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), portable path, fp32 CPU: every
linear adapted (gated q_proj, the Gated DeltaNet's in/out projections, MLP or experts), HF+PEFT logits ==
Megatron+LoRA logits in both exchange directions, and merge/unmerge."""

from __future__ import annotations

import peft
import pytest
import torch
from conftest import cpu_reference
from hybrid_models import VOCAB, hybrid_batch, make_hybrid_checkpoint
from test_lora_support import hf_model, randomize_megatron, randomize_peft

import twinkle_specs as ts
from twinkle_specs import LoraConfig, export_peft_adapter, load_peft_adapter
from twinkle_specs.lora.model import lora_modules, merge_lora, unmerge_lora

pytestmark = cpu_reference

TOL = 1e-4  # max |Δ| of fp32 logits against transformers + peft
KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LINEAR_ATTENTION = {
    "qwen3_next": {"in_proj_qkvz", "in_proj_ba", "out_proj"},
    "qwen3_5": {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"},
}
LINEAR_ATTENTION["qwen3_5_moe"] = LINEAR_ATTENTION["qwen3_5"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("hf-hybrid-lora"), {}

    def get(kind: str):
        if kind not in made:
            made[kind] = make_hybrid_checkpoint(kind, root / kind)
        return made[kind]

    return get


def _logits(model, toks: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(toks.shape[1]).expand_as(toks)
    with torch.no_grad():
        return model(toks, pos, None)[..., :VOCAB]


def _peft_logits(model, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(toks).logits


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_adapter_into_peft(kind, hybrid, tmp_path, megatron_single):
    hf = hybrid(kind)
    toks = hybrid_batch(s=24)
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.eval()
    sites = {layer.lora_site for _, _, layer in lora_modules(model)}
    assert {"linear_qkv", "linear_proj", "out_proj"} <= sites
    assert ("in_proj_fused" if kind == "qwen3_next" else "in_proj") in sites
    base = _logits(model, toks)
    randomize_megatron(model)
    ours = _logits(model, toks)
    export_peft_adapter(model, tmp_path / "adapter")
    ref_model = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "adapter")
    adapted = {n.split(".")[-1] for n, m in ref_model.named_modules() if hasattr(m, "lora_A")}
    assert LINEAR_ATTENTION[kind] | {"q_proj", "k_proj", "v_proj", "o_proj"} <= adapted
    ref = _peft_logits(ref_model, toks)
    assert (ours - base).abs().max() > 1e-2, "the adapter does not change the logits: test is vacuous"
    delta = (ours - ref).abs().max().item()
    print(f"{kind} megatron->peft max|Δ| = {delta:.3g}")
    assert delta <= TOL
    # merge folds the same adapter into the base weights; unmerge restores them bit for bit
    merge_lora(model)
    merged = _logits(model, toks)
    unmerge_lora(model)
    assert (merged - ours).abs().max().item() <= TOL
    assert torch.equal(_logits(model, toks), ours)


@pytest.mark.parametrize("kind", KINDS)
def test_peft_adapter_into_megatron(kind, hybrid, tmp_path, megatron_single):
    hf = hybrid(kind)
    toks = hybrid_batch(s=24)
    targets = sorted(LINEAR_ATTENTION[kind] | {"q_proj", "k_proj", "v_proj", "o_proj"})
    if kind == "qwen3_5":
        targets += ["gate_proj", "up_proj", "down_proj"]
    ref_model = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    randomize_peft(ref_model)
    ref_model.save_pretrained(tmp_path)
    ref = _peft_logits(ref_model, toks)
    model = ts.build_model(hf, lora=LoraConfig.from_peft(tmp_path)).eval()
    before = _logits(model, toks)
    load_peft_adapter(model, tmp_path)
    ours = _logits(model, toks)
    assert (ref - before).abs().max() > 1e-2, "the adapter does not change the logits: test is vacuous"
    delta = (ours - ref).abs().max().item()
    print(f"{kind} peft->megatron max|Δ| = {delta:.3g}")
    assert delta <= TOL
