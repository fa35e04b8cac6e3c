"""twinkle's PEFT adapters served by vLLM (GPU): an adapter exported from the Transformer Engine model loads in
vLLM, and vLLM's prompt log-probabilities with it are transformers + peft's on the same adapter: dense Qwen3,
Qwen2 and Qwen3.5 with every linear adapted, and Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE and Qwen3-Next with attention
and the routed experts (peft's ``target_parameters`` layout, which vLLM's Qwen3.5-MoE reads as written and its
Qwen3-MoE, Qwen2-MoE and Qwen3-Next with ``enable_mixed_moe_lora_format``, see tests/vllm_worker.py; or, for
Qwen3-MoE and Qwen3-Next, exported per expert: vLLM's own format for them, read without options); a MoE model
with attention only, and Qwen2-MoE's shared expert. Two cases go through ``vllm serve`` (its flags, the adapter
in ``--lora-modules``' JSON form, the OpenAI API's ``prompt_logprobs``) as docs/lora.md writes it; the rest
through vLLM's Python API.

bf16 rounds differently in each engine, so both are judged against the fp32 truth (transformers + peft in
fp32): vLLM's mean error must stay within ``VLLM_ERROR_RATIO`` of transformers + peft's own bf16 run's, with
the adapter and without it, and the adapter must move the truth by far more than either error (else the
check could not tell a dropped adapter from a loaded one). A MoE token whose router is near a tie between
its k-th and next expert can take another expert in bf16 than in fp32, and through attention that moves later
positions' log-probabilities by up to nats in either engine (transformers' own bf16 run of the top-2 case on
the CPU: 3 of 192 tokens routed otherwise in the first layer, at fp32 margins of 0.001-0.004, and a largest
error of 0.53 nats downstream). So the top-2 case is judged on means and its largest errors are evidence
only, and the MoE adapter is also served with every expert routed (top-4 of 4), where no choice can flip.
vLLM comes from the kit that scripts/gpu/vllm_kit.sh stages (the device has no network) and runs in its own
process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import models
import pytest
import torch
from gpu_checks import Evidence
from hybrid_models import HYBRID_KINDS, hf_checkpoint_model, make_hybrid_checkpoint
from test_lora_support import randomize_megatron

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (vLLM, Transformer Engine)"),
]

VLLM_KIT = Path(os.environ.get("TWINKLE_VLLM_KIT", "/tmp/gpu/vllm"))
WORKER = Path(__file__).parent / "vllm_worker.py"
EVIDENCE = Evidence("vllm-gpu.json")
RANK = 8  # one of vLLM's supported max_lora_rank values
# vLLM's bf16 kernels (fused MoE, its LoRA shrink/expand) round at other points than transformers' eager
# bf16: its mean error against the fp32 truth may be this many times transformers + peft's bf16 error
VLLM_ERROR_RATIO = 3.0
EFFECT_RATIO = 10.0  # the adapter moves the truth by at least this many times the bf16 errors (mean)
SIZE = dict(
    vocab_size=256,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
    max_position_embeddings=128,
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_TARGETS = dict(
    target_modules=ATTENTION,
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
)
DENSE = dict(intermediate_size=512)
ALL_LINEAR = dict(target_modules="all-linear")
MOE = DENSE | dict(moe_intermediate_size=128, num_experts=4)
# Gated DeltaNet layers (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj in Qwen3.5; in_proj_qkvz,
# in_proj_ba, out_proj in Qwen3-Next), which vLLM packs into in_proj_qkvz and in_proj_ba, beside gated full
# attention (tests/hybrid_models.py's layer pattern)
HYBRID = dict(
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
# every expert routed: no routing choice can flip between the engines' bf16 and the fp32 truth
HYBRID_MOE = HYBRID | dict(
    moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=4
)
# vLLM 0.26's MoE classes without is_3d_moe_weight: they take peft's fused expert layout only with the mixed
# MoE LoRA format options (tests/vllm_worker.py's --moe-3d), and a per-expert export as their own format
VLLM_UNFLAGGED_MOE = {"qwen3_moe", "qwen3_next", "qwen2_moe"}
MOE_ALL_ROUTED = MOE | dict(num_experts_per_tok=4)  # every expert routed, as HYBRID_MOE
QWEN2_MOE = MOE_ALL_ROUTED | dict(shared_expert_intermediate_size=128)  # a shared expert beside


class Case(NamedTuple):
    kind: str  # the checkpoint
    sizes: dict
    targets: dict  # the adapter's
    expert_layout: str = "fused"  # export_peft_adapter's
    serve: bool = False  # through `vllm serve --lora-modules` and its OpenAI API, not the Python API


CASES = {
    "qwen3-all-linear": Case("qwen3", DENSE, ALL_LINEAR),
    # Qwen2 / Qwen2.5: QKV bias (frozen; the adapter beside it), tied embeddings as the small releases have
    "qwen2-all-linear": Case("qwen2", DENSE, ALL_LINEAR),
    # the documented `vllm serve` line: the server's flags, the adapter in --lora-modules' JSON form
    "qwen3-all-linear-serve": Case("qwen3", DENSE, ALL_LINEAR, serve=True),
    # a MoE model with attention adapted only: no expert weights, so no mixed-format options
    "qwen3_moe-attention": Case("qwen3_moe", MOE_ALL_ROUTED, dict(target_modules=ATTENTION)),
    "qwen3_moe-attention-experts": Case("qwen3_moe", MOE | dict(num_experts_per_tok=2), MOE_TARGETS),
    "qwen3_moe-attention-experts-all-routed": Case("qwen3_moe", MOE_ALL_ROUTED, MOE_TARGETS),
    "qwen3_moe-attention-experts-all-routed-serve": Case(
        "qwen3_moe", MOE_ALL_ROUTED, MOE_TARGETS, serve=True
    ),
    "qwen3_moe-attention-experts-all-routed-per-expert": Case(
        "qwen3_moe", MOE_ALL_ROUTED, MOE_TARGETS, "per-expert"
    ),
    # a shared expert (not adapted) beside the routed ones, which the Qwen2-MoE adapter adapts
    "qwen2_moe-attention-experts-all-routed": Case("qwen2_moe", QWEN2_MOE, MOE_TARGETS),
    # the MLP names on Qwen2-MoE: its shared expert (peft and vLLM alike), the routed experts not adapted
    "qwen2_moe-attention-shared-expert": Case(
        "qwen2_moe", QWEN2_MOE, dict(target_modules=[*ATTENTION, "gate_proj", "up_proj", "down_proj"])
    ),
    # the multimodal checkpoints, as Qwen3.5 and Qwen3.5-MoE are released and as vLLM serves them (their
    # text-only classes are unregistered there); vLLM's Qwen3.5-MoE reads peft's fused expert layout as is
    "qwen3_5-all-linear": Case("qwen3_5_vl", HYBRID, ALL_LINEAR),
    "qwen3_5_moe-attention-experts-all-routed": Case("qwen3_5_moe_vl", HYBRID_MOE, MOE_TARGETS),
    "qwen3_next-attention-experts-all-routed": Case("qwen3_next", HYBRID_MOE, MOE_TARGETS),
    "qwen3_next-attention-experts-all-routed-per-expert": Case(
        "qwen3_next", HYBRID_MOE, MOE_TARGETS, "per-expert"
    ),
}


def _vllm_env() -> dict[str, str] | None:
    """The environment of vLLM's process: the staged kit first on its path, or the environment's vLLM; None
    where neither is there."""
    env = dict(os.environ)
    if VLLM_KIT.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(VLLM_KIT), env.get("PYTHONPATH")]))
        return env
    return env if importlib.util.find_spec("vllm") is not None else None


def _prompt_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of the next prompt token, [prompts, length - 1], in fp32."""
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize("case", CASES)
def test_exported_adapter_serves_in_vllm_as_in_peft(case, gpu, tmp_path):
    env = _vllm_env()
    if env is None:
        pytest.skip(
            f"needs vLLM: bash scripts/gpu/vllm_kit.sh stage (here) and install (there), or set TWINKLE_VLLM_KIT (not at {VLLM_KIT})"
        )
    import peft

    import twinkle_specs as ts

    kind, size, targets, expert_layout, serve = CASES[case]
    fused_experts = "target_parameters" in targets and expert_layout == "fused"
    if kind in HYBRID_KINDS:
        hf = make_hybrid_checkpoint(kind, tmp_path / "hf", **SIZE | size)
    else:
        hf = models.make_checkpoint(kind, tmp_path / "hf", **SIZE, **size)
    model = ts.build_model(
        hf, lora=ts.LoraConfig(r=RANK, lora_alpha=2 * RANK, **targets), parallel_output=False
    )
    randomize_megatron(model, std=0.3)
    adapter = tmp_path / "adapter"
    ts.export_peft_adapter(model, adapter, expert_layout=expert_layout)
    del model
    torch.cuda.empty_cache()

    tokens = torch.randint(0, SIZE["vocab_size"], (4, 48), generator=torch.Generator().manual_seed(1))
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    out = tmp_path / "vllm.json"
    cmd = [sys.executable, str(WORKER), "--model", str(hf), "--adapter", str(adapter), "--rank", str(RANK)]
    cmd += ["--tokens", str(tmp_path / "tokens.json"), "--out", str(out)]
    cmd += ["--moe-3d"] if fused_experts and kind in VLLM_UNFLAGGED_MOE else []
    # the server's start-up and stop besides the engine's: a longer watchdog
    cmd += ["--serve", "--watchdog", "840"] if serve else []
    log = tmp_path / "vllm.log"  # vLLM's own output, kept where the test's tmp_path is kept
    with log.open("w") as sink:
        proc = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0, f"the vLLM worker failed ({log}):\n" + log.read_text()[-6000:]
    served = json.loads(out.read_text())

    ids = tokens.cuda()
    ref: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        base = hf_checkpoint_model(hf, dtype).cuda()
        ref["base", dtype] = _prompt_logprobs(base, ids)
        ref["lora", dtype] = _prompt_logprobs(peft.PeftModel.from_pretrained(base, adapter).eval(), ids)
    stats = {"vllm": served["vllm"]}
    for which in ("base", "lora"):
        truth = ref[which, torch.float32]
        vllm_err = (torch.tensor(served[which], device="cuda") - truth).abs()
        peft_err = (ref[which, torch.bfloat16] - truth).abs()
        stats[which] = {
            "vllm_mean_abs": vllm_err.mean().item(),
            "vllm_max_abs": vllm_err.max().item(),
            "peft_bf16_mean_abs": peft_err.mean().item(),
            "peft_bf16_max_abs": peft_err.max().item(),
        }
    effect = (ref["lora", torch.float32] - ref["base", torch.float32]).abs().mean().item()
    stats["adapter_effect_mean_abs"] = effect
    EVIDENCE.record(case, **stats)
    for which in ("base", "lora"):
        s = stats[which]
        assert s["vllm_mean_abs"] <= VLLM_ERROR_RATIO * s["peft_bf16_mean_abs"], stats
        assert effect >= EFFECT_RATIO * max(s["vllm_mean_abs"], s["peft_bf16_mean_abs"]), stats
