"""LoRA on the hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), portable path, fp32 CPU: every
linear adapted (gated q_proj, the Gated DeltaNet's in/out projections, MLP or experts), HF+PEFT logits ==
Megatron+LoRA logits in both exchange directions, merge/unmerge, and at TP=2 (gloo) logits, gradients
and the adapter's round trip."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from conftest import cpu_reference
from dist_jobs import DistJobs
from hybrid_models import VOCAB, hybrid_batch, make_hybrid_checkpoint
from safetensors.torch import load_file
from test_lora_parallel import GRAD_TOL, WORKER, add_sharded_jobs, made_once, sharded_dumps
from test_lora_support import (
    EXPERT_PROJS,
    hf_model,
    randomize_megatron,
    randomize_peft,
    tokens,
    transformers4_adapter,
)
from test_lora_support import VOCAB as WORKER_VOCAB

import twinkle_specs as ts
from twinkle_specs import LoraConfig, export_peft_adapter, load_peft_adapter
from twinkle_specs.lora.model import lora_modules, merge_lora, unmerge_lora

pytestmark = cpu_reference

TOL = 1e-4  # max |Δ| of fp32 logits against transformers + peft; measured 3.1e-6 .. 1.2e-5 (torch 2.13 CPU)
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


EXPORTS = {f"{kind}-all-linear": (kind, "all-linear") for kind in KINDS}
# shared expert (Megatron's linear_fc1/fc2 name it with the routed experts), routed experts and router
EXPORTS["qwen3_5_moe-shared-routed"] = (
    "qwen3_5_moe",
    ["q_proj", "out_proj", "linear_fc1", "linear_fc2", "router"],
)


@pytest.mark.parametrize("kind,targets", list(EXPORTS.values()), ids=list(EXPORTS))
def test_megatron_adapter_into_peft(kind, targets, hybrid, tmp_path, megatron_single):
    hf = hybrid(kind)
    toks = hybrid_batch(s=24)
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    model.eval()
    sites = {layer.lora_site for _, _, layer in lora_modules(model)}
    if targets == "all-linear":
        assert {"linear_qkv", "linear_proj", "out_proj"} <= sites
        assert ("in_proj_fused" if kind == "qwen3_next" else "in_proj") in sites
    else:
        assert sites == {
            "linear_qkv",
            "out_proj",
            "linear_fc1",
            "linear_fc2",
            "experts.linear_fc1",
            "experts.linear_fc2",
            "router",
        }
    base = _logits(model, toks)
    randomize_megatron(model)
    ours = _logits(model, toks)
    export_peft_adapter(model, tmp_path / "adapter")
    ref_model = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "adapter")
    adapted = {n.split(".")[-1] for n, m in ref_model.named_modules() if hasattr(m, "lora_A")}
    if targets == "all-linear":
        assert LINEAR_ATTENTION[kind] | {"q_proj", "k_proj", "v_proj", "o_proj"} <= adapted
    else:
        assert {"q_proj", "out_proj", "gate_proj", "up_proj", "down_proj", "experts", "gate"} <= adapted
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


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
IMPORTS = {
    "qwen3_next": ("qwen3_next", dict(target_modules=sorted(LINEAR_ATTENTION["qwen3_next"]) + ATTENTION)),
    # per-slot ranks and alphas inside the fused in_proj and QKV
    "qwen3_5-rank-pattern": (
        "qwen3_5",
        dict(
            target_modules=sorted(LINEAR_ATTENTION["qwen3_5"])
            + ATTENTION
            + ["gate_proj", "up_proj", "down_proj"],
            rank_pattern={r".*\.in_proj_b": 2, r".*\.k_proj": 6},
            alpha_pattern={r".*\.in_proj_z": 3},
        ),
    ),
    # v4 MLP names: routed experts on Qwen3-Next (gate_up_proj at rank 2r, as on Qwen3-MoE), the shared
    # expert on Qwen3.5-MoE (as on Qwen2-MoE): what peft does on each
    "qwen3_next-v4-names": (
        "qwen3_next",
        dict(target_modules=["in_proj_ba", "gate_proj", "up_proj", "down_proj"]),
    ),
    "qwen3_5_moe-v4-names": (
        "qwen3_5_moe",
        dict(target_modules=["in_proj_qkv", "q_proj", "gate_proj", "up_proj", "down_proj"]),
    ),
}


@pytest.mark.parametrize("kind,targets", list(IMPORTS.values()), ids=list(IMPORTS))
def test_peft_adapter_into_megatron(kind, targets, hybrid, tmp_path, megatron_single):
    hf = hybrid(kind)
    toks = hybrid_batch(s=24)
    ref_model = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, **targets))
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


def test_transformers4_per_expert_adapter_into_qwen3_next(hybrid, tmp_path, megatron_single):
    """Qwen3-Next's routed experts in the per-expert layout of transformers 4, as peft 0.21 reads them."""
    hf = hybrid("qwen3_next")
    adapter = transformers4_adapter(hf, tmp_path / "adapter", EXPERT_PROJS)
    inert = transformers4_adapter(hf, tmp_path / "inert", EXPERT_PROJS, expert_b_scale=0.0)
    toks = hybrid_batch(s=24)
    ref = _peft_logits(peft.PeftModel.from_pretrained(hf_model(hf), adapter), toks)
    assert (ref - _peft_logits(peft.PeftModel.from_pretrained(hf_model(hf), inert), toks)).abs().max() > 1e-2
    model = ts.build_model(hf, lora=LoraConfig.from_peft(adapter)).eval()
    load_peft_adapter(model, adapter)
    delta = (_logits(model, toks) - ref).abs().max().item()
    print(f"qwen3_next transformers-4 experts max|Δ| = {delta:.3g}")
    assert delta <= TOL


def test_per_expert_export_of_qwen3_next(hybrid, tmp_path, megatron_single):
    """Qwen3-Next's routed experts exported per expert (what vLLM reads without options) load in peft 0.21
    as the model computes them, and a shared expert adapted beside them is refused by name (on transformers 4
    gate_proj/up_proj/down_proj would name both)."""
    hf = hybrid("qwen3_next")
    lora = LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=["q_proj"],
        target_parameters=[f"mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")],
    )
    model = ts.build_model(hf, lora=lora).eval()
    toks = hybrid_batch(s=24)
    base = _logits(model, toks)
    randomize_megatron(model)
    ours = _logits(model, toks)
    export_peft_adapter(model, tmp_path / "adapter", expert_layout="per-expert")
    ref = _peft_logits(peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "adapter"), toks)
    assert (ours - base).abs().max() > 1e-2
    delta = (ours - ref).abs().max().item()
    print(f"qwen3_next per-expert export max|Δ| = {delta:.3g}")
    assert delta <= TOL
    shared = ts.build_model(
        hf, lora=LoraConfig(r=4, lora_alpha=16, target_modules=["linear_fc1", "linear_fc2"])
    )
    with pytest.raises(ValueError, match="its shared expert .* is adapted too"):
        export_peft_adapter(shared, tmp_path / "shared", expert_layout="per-expert")


def test_transformers4_shared_expert_factors_are_refused_not_dropped(hybrid, tmp_path, megatron_single):
    """A transformers-4 adapter naming gate_proj also adapted Qwen3-Next's shared expert (peft matched the
    suffix); on transformers 5 the names mean the routed experts and peft 0.21 drops the shared expert's
    factors without a warning. twinkle refuses them by name instead."""
    hf = hybrid("qwen3_next")
    shared = {
        name.removesuffix(".weight"): weight.shape
        for name, weight in hf_model(hf).named_parameters()
        if ".mlp.shared_expert." in name and name.endswith("_proj.weight")
    }

    def add_shared(tensors: dict) -> None:
        for module, (out, fan_in) in shared.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.ones(4, fan_in)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.ones(out, 4)

    adapter = transformers4_adapter(hf, tmp_path / "adapter", EXPERT_PROJS, edit=add_shared)
    model = ts.build_model(hf, lora=LoraConfig.from_peft(adapter))
    with pytest.raises(ValueError, match=r"shared_expert.*drops without a warning.*remove the shared_expert"):
        load_peft_adapter(model, adapter)


def _peft_adapter(hf, out, targets) -> None:
    ref_model = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    randomize_peft(ref_model)
    ref_model.save_pretrained(out)


def _peft_reference(hf, adapter):
    """PEFT's logits (the worker's first WORKER_VOCAB) and adapter gradients of the worker's loss."""
    model = peft.PeftModel.from_pretrained(hf_model(hf), adapter, is_trainable=True)
    toks = tokens()
    weights = torch.randn(*toks.shape, WORKER_VOCAB, generator=torch.Generator().manual_seed(7))
    logits = model(toks).logits[..., :WORKER_VOCAB]
    (logits * weights).sum().backward()
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}
    return logits.detach(), grads


FUSED_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]
SHARDED_LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"])}


def _tp2_job(hybrid, kind: str, targets, *flags: str):
    """A worker job at TP=2 on the ``kind`` checkpoint with a random adapter on ``targets`` (OUT/adapter)."""

    def prepare(out: Path) -> list[str]:
        _peft_adapter(hybrid(kind), out / "adapter", targets)
        return [
            "--hf",
            str(hybrid(kind)),
            "--adapter",
            str(out / "adapter"),
            "--out",
            str(out),
            *flags,
            "--tp",
            "2",
        ]

    return prepare


def _sharded_inputs(hybrid, kind: str, root: Path):
    def make():
        _peft_adapter(hybrid(kind), root / "adapter", sorted(LINEAR_ATTENTION[kind]) + ["q_proj", "v_proj"])
        return hybrid(kind), root / "adapter"

    return made_once(make)


@pytest.fixture(scope="module")
def lora_jobs(hybrid, tmp_path_factory, request):
    """This module's multi-rank runs of test_lora_worker.py: one torchrun launch per world size for all
    the selected tests (tests/dist_jobs.py); each test asserts on its own job's outputs."""
    root = tmp_path_factory.mktemp("hybrid-lora-layouts")
    jobs = DistJobs(WORKER, root, request, timeout=240, cpu_only=True)
    jobs.add("tp2-matches", 2, _tp2_job(hybrid, "qwen3_5", "all-linear"), test="test_tp2_matches_peft")
    fused = _tp2_job(hybrid, "qwen3_next", FUSED_TARGETS, "--roundtrip")
    jobs.add("tp2-fused-roundtrip", 2, fused, test="test_tp2_round_trips_fused_projections")
    for kind in ("qwen3_5", "qwen3_next"):
        test = f"test_adapter_sharded_state_dict_is_tp_independent[{kind}]"
        add_sharded_jobs(jobs, test, _sharded_inputs(hybrid, kind, root / f"{kind}-inputs"), SHARDED_LAYOUTS)
    return jobs


def test_tp2_matches_peft(hybrid, lora_jobs):
    """Qwen3.5 at TP=2 (gloo): queries/gates and the Gated DeltaNet's sections split per rank; logits and
    adapter gradients against PEFT, then an export after re-randomising."""
    hf = hybrid("qwen3_5")
    out = lora_jobs.out("tp2-matches")
    adapter = out / "adapter"

    ref_logits, ref_grads = _peft_reference(hf, adapter)
    ours = torch.load(out / "logits_in.pt")
    print(f"qwen3_5 tp2 logits max|Δ| = {(ours - ref_logits).abs().max().item():.3g}")
    assert (ours - ref_logits).abs().max().item() <= TOL
    grads = torch.load(out / "grads.pt")
    assert sorted(grads) == sorted(ref_grads)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    print(f"qwen3_5 tp2 grads max|Δ| = {worst:.3g} (largest grad {scale:.3g})")
    assert worst <= GRAD_TOL * scale

    exported = peft.PeftModel.from_pretrained(hf_model(hf), out / "export").eval()
    with torch.no_grad():
        ref_out = exported(tokens()).logits
    ours_out = torch.load(out / "logits_out.pt")
    assert (ours_out - ref_logits).abs().max() > 1e-2  # the re-randomised adapter is a different one
    print(f"qwen3_5 tp2 export max|Δ| = {(ours_out - ref_out[..., :WORKER_VOCAB]).abs().max().item():.3g}")
    assert (ours_out - ref_out[..., :WORKER_VOCAB]).abs().max().item() <= TOL


def test_tp2_round_trips_fused_projections(lora_jobs):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped per key head) and gated q_proj at TP=2: a PEFT
    adapter loaded into the shards and exported again is the same file."""
    out = lora_jobs.out("tp2-fused-roundtrip")
    src = load_file(out / "adapter" / "adapter_model.safetensors")
    back = load_file(out / "export" / "adapter_model.safetensors")
    assert sorted(src) == sorted(back)
    for key, t in src.items():
        assert torch.equal(t, back[key]), key


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_adapter_sharded_state_dict_is_tp_independent(kind, lora_jobs):
    """Adapter-only sharded_state_dict at TP=2 describes the same global tensors as at TP=1: the Gated
    DeltaNet's in_proj slots are saved per section ([q; k; v] ...), each split over TP on its own."""
    dumps = sharded_dumps(
        lora_jobs, f"test_adapter_sharded_state_dict_is_tp_independent[{kind}]", SHARDED_LAYOUTS
    )
    reference, tp2 = dumps["tp1"], dumps["tp2"]
    assert any(
        key.endswith("in_proj.lora_B.in_proj_qkv_q" if kind == "qwen3_5" else "lora_B.in_proj_ba_a")
        for key in reference
    ), sorted(reference)
    assert sorted(tp2) == sorted(reference)
    for key, (full, count) in tp2.items():
        # hybrid layers: a linear-attention (or attention) factor exists in some layers only
        assert torch.equal(count, reference[key][1]) and count.max() == 1, key
        assert torch.equal(full, reference[key][0]), key


def test_sectioned_factors_load_back(hybrid, megatron_single):
    """The per-section checkpoint tensors of in_proj's B are put back where they came from (what loading
    an adapter-only checkpoint does with them)."""
    model = ts.build_model(
        hybrid("qwen3_next"), lora=LoraConfig(r=4, target_modules=["in_proj_qkvz", "in_proj_ba"])
    )
    randomize_megatron(model)
    (layer, *_) = [m for _, _, m in lora_modules(model) if m.lora_site == "in_proj_fused"]
    data = layer.lora_view("B", layer.lora_leaf("B").detach())
    built = layer._lora_build_sharded("B", (), None, "x.lora_B", data, None, None)
    assert sorted(built) == [
        f"x.lora_B.in_proj_{s}" for s in ("ba_a", "ba_b", "qkvz_k", "qkvz_q", "qkvz_v", "qkvz_z")
    ]
    assert torch.equal(
        layer._lora_merge_sharded("B", data.shape, {k: t.data for k, t in built.items()}), data
    )
