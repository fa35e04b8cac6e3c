"""The transformers variants: (d) transformers + PEFT LoRA and (f) a full fine-tune, both with sdpa
attention and torch AdamW (fused on a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from .device import device, on_gpu
from .settings import Prepared, Settings, count_params
from .timing import CLOCK


def prepare(hf_dir: Path, s: Settings, peft_lora: bool = False) -> Prepared:
    """A transformers model from the config in ``hf_dir`` (random weights, seeded), with PEFT LoRA on all
    linear layers when ``peft_lora``, its optimizer and data."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(s.seed)
    dev = device()
    config = AutoConfig.from_pretrained(hf_dir)
    config.use_cache = False
    with dev:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=s.torch_dtype())
    result: dict[str, Any] = {"impl": f"transformers {model.config._attn_implementation}"}
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        # transformers' Gated DeltaNet takes fla's kernel whenever fla is installed, else its torch rule
        fla = importlib.util.find_spec("fla") is not None
        result["gdn_rule"] = "fla chunk_gated_delta_rule" if fla else "torch reference (transformers')"
    experts = getattr(model.config, "_experts_implementation", None)
    if experts and getattr(config, "num_experts", None):
        result["impl"] += f", experts {experts}"
    if peft_lora:
        import peft

        # all-linear also takes an MoE shared expert's one-output gate (Qwen3.5-MoE), which twinkle-specs'
        # LoRA does not adapt: left out, so that (c) and (d) train the same adapters
        excluded = (
            ["shared_expert_gate"]
            if any(n.endswith(".shared_expert_gate") for n, _ in model.named_modules())
            else None
        )
        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=s.lora_r,
                lora_alpha=s.lora_alpha,
                target_modules="all-linear",
                exclude_modules=excluded,
                lora_dropout=0.0,
            ),
        )
        if excluded:
            result["peft_exclude_modules"] = excluded
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
        result["adapter_dtypes"] = dtypes  # peft upcasts adapters to fp32 by default (autocast_adapter_dtype)
    model.train()
    result["total_params"], result["trainable_params"] = count_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=on_gpu())
    result["optimizer"] = "torch.optim.AdamW" + (" (fused)" if on_gpu() else "")
    gen = torch.Generator().manual_seed(s.seed)
    tokens = torch.randint(0, config.vocab_size, (s.micro_batch_size, s.seq_len), generator=gen).to(dev)

    def forward():
        with CLOCK.phase("forward"):
            return model(input_ids=tokens, labels=tokens).loss

    def backward_and_update(loss):
        with CLOCK.phase("backward"):
            loss.backward()
        with CLOCK.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    def step():
        return backward_and_update(forward())

    result["step"] = "forward + backward + optimizer step"
    return Prepared(result, step, forward, backward_and_update)


def peft_lora(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s, peft_lora=True)


def full(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s)
